// ATen glue for the asynchronous I/O handle: torch.classes.deepspeed_cpp.AsyncIOHandle.
//
// The handle is a custom class rather than a set of ops because it is stateful (worker threads,
// requests in flight between calls) and its calls are side effects on files, which have no
// meaning inside a traced graph. Custom classes must be registered by the library that
// implements them, hence TORCH_LIBRARY_FRAGMENT here and not a schema in registration.cpp.
#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>
#include <unordered_map>
#include <vector>

#include "aio_handle.h"
#include "locked_memory.h"

namespace deepspeed_cpp {
namespace aio {
namespace {

class AsyncIOHandle : public torch::CustomClassHolder {
 public:
  AsyncIOHandle(int64_t block_size, int64_t queue_depth, bool single_submit, bool overlap_events,
                int64_t intra_op_parallelism, std::string engine)
      : core_(make_core(block_size, queue_depth, single_submit, overlap_events,
                        intra_op_parallelism, engine)) {}

  ~AsyncIOHandle() override {
    core_.reset();  // waits for requests in flight before their storages are let go
    release_storages();
  }

  int64_t async_pread(const at::Tensor& buffer, const std::string& filename, int64_t file_offset) {
    submit(IoDirection::kRead, "async_pread", buffer, filename, file_offset);
    return 0;
  }

  int64_t async_pwrite(const at::Tensor& buffer, const std::string& filename, int64_t file_offset,
                       bool truncate) {
    submit(IoDirection::kWrite, "async_pwrite", buffer, filename, file_offset, truncate);
    return 0;
  }

  int64_t sync_pread(const at::Tensor& buffer, const std::string& filename, int64_t file_offset) {
    submit(IoDirection::kRead, "sync_pread", buffer, filename, file_offset);
    return wait();
  }

  int64_t sync_pwrite(const at::Tensor& buffer, const std::string& filename, int64_t file_offset,
                      bool truncate) {
    submit(IoDirection::kWrite, "sync_pwrite", buffer, filename, file_offset, truncate);
    return wait();
  }

  int64_t wait() {
    int64_t completed = 0;
    std::string failure;
    try {
      completed = core_->wait();
    } catch (const std::exception& error) {
      failure = error.what();
    }
    // Every request has finished, failed or not: the tensors are free to change again.
    release_storages();
    warn_about_buffered_fallback();
    TORCH_CHECK(failure.empty(), failure);
    return completed;
  }

  int64_t pending_requests() { return core_->pending(); }

  at::Tensor new_cpu_locked_tensor(int64_t num_elem, const at::Tensor& example_tensor) {
    TORCH_CHECK(num_elem >= 0, "AsyncIOHandle.new_cpu_locked_tensor: num_elem must be >= 0, got ",
                num_elem);
    const at::ScalarType dtype = example_tensor.scalar_type();
    const int64_t bytes = num_elem * static_cast<int64_t>(c10::elementSize(dtype));
    at::Tensor tensor;
    if (at::hasCUDA()) {
      // Pinned by CUDA, so that copies to the GPU are asynchronous DMA; cut at a page boundary
      // so that O_DIRECT needs no bounce buffer.
      at::Tensor raw = at::empty({bytes + kDirectIoAlignment},
                                 at::TensorOptions().dtype(at::kByte).pinned_memory(true));
      const auto address = reinterpret_cast<std::uintptr_t>(raw.data_ptr());
      const int64_t skip = static_cast<int64_t>(
          (kDirectIoAlignment - address % kDirectIoAlignment) % kDirectIoAlignment);
      tensor = raw.narrow(0, skip, bytes).view(dtype);
    } else {
      void* memory = allocate_locked(static_cast<std::size_t>(bytes));
      tensor = at::from_blob(
          memory, {num_elem},
          [bytes](void* data) { free_locked(data, static_cast<std::size_t>(bytes)); },
          at::TensorOptions().dtype(dtype));
    }
    // Forget the ones whose memory is gone already, then remember this one.
    locked_.erase(std::remove_if(locked_.begin(), locked_.end(),
                                 [](const auto& weak) { return weak.expired(); }),
                  locked_.end());
    locked_.push_back(tensor.storage().getWeakStorageImpl());
    return tensor;
  }

  bool free_cpu_locked_tensor(at::Tensor tensor) {
    c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
    TORCH_CHECK(held_.count(storage) == 0,
                "AsyncIOHandle.free_cpu_locked_tensor: the tensor has a request in flight; call "
                "wait() before freeing it");
    for (auto it = locked_.begin(); it != locked_.end(); ++it) {
      if (it->_unsafe_get_target() != storage || it->expired()) continue;
      locked_.erase(it);
      // The memory goes back when the last tensor viewing it goes; this one now views nothing.
      tensor.set_();
      return true;
    }
    return false;
  }

  int64_t get_block_size() { return core_->config().block_size; }
  int64_t get_queue_depth() { return core_->config().queue_depth; }
  bool get_single_submit() { return core_->config().single_submit; }
  bool get_overlap_events() { return core_->config().overlap_events; }
  int64_t get_intra_op_parallelism() { return core_->config().intra_op_parallelism; }
  std::string get_engine() { return engine_name(core_->engine()); }

  c10::Dict<std::string, int64_t> get_stats() {
    const TransferStats stats = core_->stats();
    c10::Dict<std::string, int64_t> result;
    result.insert("direct_bytes", stats.direct_bytes);
    result.insert("buffered_bytes", stats.buffered_bytes);
    result.insert("bounced_bytes", stats.bounced_bytes);
    return result;
  }

 private:
  // A storage with requests in flight: held so that freeing the tensor cannot free the memory,
  // and made non-resizable so that resize_ cannot move it.
  struct HeldStorage {
    c10::Storage storage;
    bool was_resizable;
  };

  static std::unique_ptr<AioHandle> make_core(int64_t block_size, int64_t queue_depth,
                                              bool single_submit, bool overlap_events,
                                              int64_t intra_op_parallelism,
                                              const std::string& engine) {
    try {
      return std::make_unique<AioHandle>(HandleConfig{block_size, queue_depth, single_submit,
                                                      overlap_events, intra_op_parallelism,
                                                      parse_engine(engine)});
    } catch (const std::exception& error) {
      TORCH_CHECK(false, error.what());
    }
  }

  void submit(IoDirection direction, const char* method, const at::Tensor& buffer,
              const std::string& filename, int64_t file_offset, bool truncate = true) {
    TORCH_CHECK(buffer.defined(), "AsyncIOHandle.", method, ": buffer is an undefined tensor");
    TORCH_CHECK(buffer.device().is_cpu(), "AsyncIOHandle.", method,
                ": buffer must be a CPU tensor, got device ", buffer.device());
    TORCH_CHECK(buffer.layout() == at::kStrided, "AsyncIOHandle.", method,
                ": buffer must be a dense (strided) tensor, got layout ", buffer.layout());
    TORCH_CHECK(buffer.is_contiguous(), "AsyncIOHandle.", method,
                ": buffer must be contiguous, got strides ", buffer.strides(), " for shape ",
                buffer.sizes());
    TORCH_CHECK(!buffer.is_conj() && !buffer.is_neg(), "AsyncIOHandle.", method,
                ": buffer is a lazily conjugated/negated view; call resolve_conj()/resolve_neg()");
    TORCH_CHECK(!filename.empty(), "AsyncIOHandle.", method, ": filename is empty");
    TORCH_CHECK(file_offset >= 0, "AsyncIOHandle.", method, ": file_offset must be >= 0, got ",
                file_offset);
    hold(buffer.storage());
    core_->submit(direction, static_cast<char*>(buffer.data_ptr()), buffer.nbytes(), filename,
                  file_offset, truncate);
    warn_about_buffered_fallback();
  }

  void hold(const c10::Storage& storage) {
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    if (held_.count(impl) != 0) return;
    held_.emplace(impl, HeldStorage{storage, impl->resizable()});
    impl->set_resizable(false);
  }

  void release_storages() {
    for (auto& entry : held_)
      entry.second.storage.unsafeGetStorageImpl()->set_resizable(entry.second.was_resizable);
    held_.clear();
  }

  void warn_about_buffered_fallback() {
    const std::string notice = core_->take_buffered_fallback_notice();
    if (!notice.empty()) TORCH_WARN(notice);
  }

  std::unique_ptr<AioHandle> core_;
  std::unordered_map<c10::StorageImpl*, HeldStorage> held_;
  std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>> locked_;
};

// Static strings for the extern "C" descriptions below.
std::string& text_slot() {
  static thread_local std::string text;
  return text;
}

}  // namespace
}  // namespace aio
}  // namespace deepspeed_cpp

TORCH_LIBRARY_FRAGMENT(deepspeed_cpp, m) {
  using deepspeed_cpp::aio::AsyncIOHandle;
  const auto io_args = {torch::arg("buffer"), torch::arg("filename"),
                        torch::arg("file_offset") = int64_t{0}};
  // truncate=False: a write at offset 0 keeps a longer file's length (writing a file in parts).
  const auto write_args = {torch::arg("buffer"), torch::arg("filename"),
                           torch::arg("file_offset") = int64_t{0}, torch::arg("truncate") = true};
  m.class_<AsyncIOHandle>("AsyncIOHandle")
      .def(torch::init<int64_t, int64_t, bool, bool, int64_t, std::string>(), "",
           {torch::arg("block_size") = int64_t{1} << 20, torch::arg("queue_depth") = int64_t{32},
            torch::arg("single_submit") = false, torch::arg("overlap_events") = true,
            torch::arg("intra_op_parallelism") = int64_t{1}, torch::arg("engine") = "auto"})
      .def("async_pread", &AsyncIOHandle::async_pread, "", io_args)
      .def("async_pwrite", &AsyncIOHandle::async_pwrite, "", write_args)
      .def("sync_pread", &AsyncIOHandle::sync_pread, "", io_args)
      .def("sync_pwrite", &AsyncIOHandle::sync_pwrite, "", write_args)
      .def("wait", &AsyncIOHandle::wait)
      .def("pending_requests", &AsyncIOHandle::pending_requests)
      .def("new_cpu_locked_tensor", &AsyncIOHandle::new_cpu_locked_tensor, "",
           {torch::arg("num_elem"), torch::arg("example_tensor")})
      .def("free_cpu_locked_tensor", &AsyncIOHandle::free_cpu_locked_tensor)
      .def("get_block_size", &AsyncIOHandle::get_block_size)
      .def("get_queue_depth", &AsyncIOHandle::get_queue_depth)
      .def("get_single_submit", &AsyncIOHandle::get_single_submit)
      .def("get_overlap_events", &AsyncIOHandle::get_overlap_events)
      .def("get_intra_op_parallelism", &AsyncIOHandle::get_intra_op_parallelism)
      .def("get_engine", &AsyncIOHandle::get_engine)
      .def("get_stats", &AsyncIOHandle::get_stats);
}

// Read by the report command and the tests through ctypes; they describe the build and the
// kernel, not tensors. Each returns a string that stays valid until the next call in the thread.

// The engine a handle made with engine="auto" gets in this process (honours DS_AIO_ENGINE).
extern "C" const char* deepspeed_cpp_aio_default_engine() {
  std::string& text = deepspeed_cpp::aio::text_slot();
  try {
    text = deepspeed_cpp::aio::engine_name(
        deepspeed_cpp::aio::resolve_engine(deepspeed_cpp::aio::EngineKind::kAuto));
  } catch (const std::exception& error) {
    text = std::string("error: ") + error.what();
  }
  return text.c_str();
}

// Comma-separated engines compiled into this library, best first.
extern "C" const char* deepspeed_cpp_aio_compiled_engines() {
  std::string& text = deepspeed_cpp::aio::text_slot();
  text.clear();
  for (auto kind : deepspeed_cpp::aio::compiled_engines()) {
    if (!text.empty()) text += ",";
    text += deepspeed_cpp::aio::engine_name(kind);
  }
  return text.c_str();
}

// "" when the named engine can run here, else why not.
extern "C" const char* deepspeed_cpp_aio_engine_unavailable_reason(const char* name) {
  std::string& text = deepspeed_cpp::aio::text_slot();
  try {
    text = deepspeed_cpp::aio::engine_unavailable_reason(deepspeed_cpp::aio::parse_engine(name));
  } catch (const std::exception& error) {
    text = error.what();
  }
  return text.c_str();
}
