#include "aio_handle.h"

#include <algorithm>
#include <stdexcept>

namespace deepspeed_cpp {
namespace aio {
namespace {

void check_setting(bool ok, const std::string& name, int64_t value, const std::string& expected) {
  if (!ok) {
    throw std::invalid_argument("AsyncIOHandle: " + name + " must be " + expected + ", got " +
                                std::to_string(value));
  }
}

}  // namespace

AioHandle::AioHandle(const HandleConfig& config) : config_(config) {
  check_setting(config.block_size > 0 && config.block_size % kDirectIoAlignment == 0 &&
                    config.block_size <= (int64_t{1} << 30),
                "block_size", config.block_size,
                "a positive multiple of " + std::to_string(kDirectIoAlignment) +
                    " (O_DIRECT alignment) of at most 1 GiB");
  check_setting(config.queue_depth >= 1 && config.queue_depth <= 4096, "queue_depth",
                config.queue_depth, "in [1, 4096]");
  check_setting(config.intra_op_parallelism >= 1 && config.intra_op_parallelism <= 256,
                "intra_op_parallelism", config.intra_op_parallelism, "in [1, 256]");
  engine_ = resolve_engine(config.engine);
  config_.engine = engine_;
  const WorkerSettings settings{config.block_size, static_cast<int>(config.queue_depth),
                                config.single_submit, config.overlap_events};
  for (int64_t i = 0; i < config.intra_op_parallelism; ++i) {
    workers_.push_back(
        std::make_unique<IoWorker>(settings, make_engine(engine_, settings.queue_depth), *this));
  }
}

AioHandle::~AioHandle() {
  std::unique_lock<std::mutex> lock(mutex_);
  finished_changed_.wait(lock,
                         [this] { return finished_ == static_cast<int64_t>(requests_.size()); });
  lock.unlock();
  workers_.clear();
}

void AioHandle::submit(IoDirection direction, char* buffer, int64_t bytes, const std::string& path,
                       int64_t file_offset, bool truncate) {
  auto request = std::make_shared<FileRequest>(
      RequestSpec{direction, buffer, bytes, path, file_offset, truncate});
  if (!request->direct_refusal().empty()) {
    note_buffered_fallback(*request, "open(O_DIRECT) failed with " + request->direct_refusal());
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    requests_.push_back(request);
    if (request->failed() || bytes == 0) {
      ++finished_;  // nothing to transfer: done (or failed) already
      return;
    }
  }
  post_slices(request);
}

void AioHandle::post_slices(const std::shared_ptr<FileRequest>& request) {
  // The aligned body's blocks are shared out in contiguous runs, one per worker; a request
  // smaller than two blocks goes to one worker, taken in turn so that many small requests
  // still spread over all of them.
  const int64_t block = config_.block_size;
  const int64_t body_blocks = (request->body_end() - request->body_begin() + block - 1) / block;
  const int64_t workers = static_cast<int64_t>(workers_.size());
  const int64_t parts = body_blocks >= 2 ? std::min(workers, body_blocks) : 1;
  request->open_slices.store(static_cast<int>(parts), std::memory_order_relaxed);
  for (int64_t part = 0; part < parts; ++part) {
    auto slice = std::make_shared<WorkSlice>();
    slice->request = request;
    const int64_t first_block = part * body_blocks / parts;
    const int64_t end_block = (part + 1) * body_blocks / parts;
    slice->cursor = part == 0 ? request->begin() : request->body_begin() + first_block * block;
    slice->end = part == parts - 1 ? request->end() : request->body_begin() + end_block * block;
    workers_[next_worker_]->post(std::move(slice));
    next_worker_ = (next_worker_ + 1) % workers_.size();
  }
}

int64_t AioHandle::wait() {
  std::vector<std::shared_ptr<FileRequest>> done;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    finished_changed_.wait(lock,
                           [this] { return finished_ == static_cast<int64_t>(requests_.size()); });
    done.swap(requests_);
    finished_ = 0;
  }
  std::string errors;
  int64_t failures = 0;
  for (const auto& request : done) {
    const std::string message = request->error_message();
    if (message.empty()) continue;
    ++failures;
    errors += "\n  " + message;
  }
  if (failures > 0) {
    throw std::runtime_error("AsyncIOHandle.wait: " + std::to_string(failures) + " of " +
                             std::to_string(done.size()) + " requests failed:" + errors);
  }
  return static_cast<int64_t>(done.size());
}

int64_t AioHandle::pending() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(requests_.size());
}

TransferStats AioHandle::stats() const {
  return TransferStats{direct_bytes_.load(), buffered_bytes_.load(), bounced_bytes_.load()};
}

std::string AioHandle::take_buffered_fallback_notice() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::string notice;
  notice.swap(fallback_notice_);
  return notice;
}

void AioHandle::request_finished(FileRequest&) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++finished_;
  }
  finished_changed_.notify_all();
}

void AioHandle::count_transfer(bool direct, bool bounced, int64_t bytes) {
  (direct ? direct_bytes_ : buffered_bytes_).fetch_add(bytes, std::memory_order_relaxed);
  if (bounced) bounced_bytes_.fetch_add(bytes, std::memory_order_relaxed);
}

void AioHandle::direct_io_refused(const FileRequest& request, const std::string& why) {
  note_buffered_fallback(request, why);
}

void AioHandle::note_buffered_fallback(const FileRequest& request, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (fallback_noticed_) return;
  fallback_noticed_ = true;
  fallback_notice_ = "AsyncIOHandle: the file system of '" + request.spec().path +
                     "' does not support O_DIRECT (" + why +
                     "); this handle uses buffered I/O (through the page cache) for such files. "
                     "Put swap files on a local disk file system (ext4, xfs) for full speed.";
}

}  // namespace aio
}  // namespace deepspeed_cpp
