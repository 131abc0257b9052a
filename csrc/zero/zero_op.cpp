// ATen glue for csrc/zero: flat-buffer copies, bucket planning, and the GradientReducer class.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "bucket_plan.h"
#include "grad_reducer.h"
#include "reducer_buffers.h"

namespace deepspeed_cpp {
namespace {

void check_flat(const at::Tensor& flat, at::TensorList tensors, at::IntArrayRef offsets,
                const char* op) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), op,
              ": flat must be a contiguous 1-D tensor, got shape ", flat.sizes(), " and strides ",
              flat.strides());
  TORCH_CHECK(offsets.size() == tensors.size(), op, ": got ", tensors.size(), " tensors but ",
              offsets.size(), " offsets");
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].device() == flat.device(), op, ": tensors[", i, "] is on ",
                tensors[i].device(), " but flat is on ", flat.device());
    // `offset <= flat - numel` rather than `offset + numel <= flat`: no overflow for any offset.
    TORCH_CHECK(offsets[i] >= 0 && offsets[i] <= flat.numel() - tensors[i].numel(), op,
                ": tensors[", i, "] (", tensors[i].numel(), " elements at offset ", offsets[i],
                ") does not fit in flat of ", flat.numel(), " elements");
  }
}

void zero_flatten_into(at::TensorList tensors, at::Tensor& flat, at::IntArrayRef offsets) {
  check_flat(flat, tensors, offsets, "zero_flatten_into");
  for (size_t i = 0; i < tensors.size(); ++i) {
    flat.narrow(0, offsets[i], tensors[i].numel()).copy_(tensors[i].reshape({-1}));
  }
}

void zero_unflatten_from(const at::Tensor& flat, at::TensorList tensors, at::IntArrayRef offsets) {
  check_flat(flat, tensors, offsets, "zero_unflatten_from");
  for (size_t i = 0; i < tensors.size(); ++i) {
    // TensorList elements are const; the schema marks them written (Tensor(a!)[]).
    at::Tensor target = tensors[i];
    target.copy_(flat.narrow(0, offsets[i], target.numel()).view(target.sizes()));
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> zero_plan_buckets(
    at::IntArrayRef numels, at::IntArrayRef groups, int64_t capacity, int64_t world_size,
    int64_t alignment, at::IntArrayRef alone) {
  BucketPlan plan;
  try {
    plan = plan_buckets(numels.vec(), groups.vec(), alone.vec(), capacity, world_size, alignment);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK(false, error.what());
  }
  const int64_t num_params = static_cast<int64_t>(plan.slots.size());
  at::Tensor slots = at::empty({num_params, 2}, at::kLong);
  auto slot = slots.accessor<int64_t, 2>();
  for (int64_t p = 0; p < num_params; ++p) {
    slot[p][0] = plan.slots[p].bucket;
    slot[p][1] = plan.slots[p].offset;
  }
  at::Tensor sizes = at::tensor(plan.bucket_sizes, at::kLong);
  at::Tensor bucket_groups = at::tensor(plan.bucket_groups, at::kLong);
  return {slots, sizes, bucket_groups};
}

}  // namespace

// The reducer's buffers on their own, for tests: every allocation and device decision the
// reducer makes, exercised with no process group (on `meta`, or a device the host lacks).
class ReducerBuffersForTest : public torch::CustomClassHolder {
 public:
  ReducerBuffersForTest(std::vector<int64_t> param_bucket, std::vector<int64_t> param_offset,
                        std::vector<int64_t> param_numel, std::vector<int64_t> bucket_sizes,
                        const std::string& device)
      : buffers_(std::move(param_bucket), std::move(param_offset), std::move(param_numel),
                 std::move(bucket_sizes), ReducerBuffers::parse_device(device)) {}

  std::string device() const { return buffers_.device().str(); }
  bool add_grad(int64_t param, const at::Tensor& grad) { return buffers_.add_grad(param, grad); }
  bool complete(int64_t bucket) const { return buffers_.complete(checked(bucket)); }
  bool fill_missing(int64_t bucket) { return buffers_.fill_missing(checked(bucket)); }
  // None until the bucket's first gradient (an undefined tensor reaches Python as None).
  at::Tensor buffer(int64_t bucket) { return buffers_.buffer(checked(bucket)); }
  void check_destination(int64_t bucket, const at::Tensor& destination, int64_t numel) const {
    buffers_.check_destination(checked(bucket), destination, numel);
  }
  void reset() { buffers_.reset(); }

 private:
  // GradientReducer only passes valid bucket indices; Python callers may not.
  int64_t checked(int64_t bucket) const {
    TORCH_CHECK(bucket >= 0 && bucket < buffers_.num_buckets(), "ReducerBuffers: bucket ", bucket,
                " is out of range [0, ", buffers_.num_buckets(), ")");
    return bucket;
  }

  ReducerBuffers buffers_;
};

}  // namespace deepspeed_cpp

TORCH_LIBRARY_IMPL(deepspeed_cpp, CompositeExplicitAutograd, m) {
  m.impl("zero_flatten_into", &deepspeed_cpp::zero_flatten_into);
  m.impl("zero_unflatten_from", &deepspeed_cpp::zero_unflatten_from);
  m.impl("zero_plan_buckets", &deepspeed_cpp::zero_plan_buckets);
}

// A custom class must be registered by the library that implements it, so these are the only
// schema-like registrations outside csrc/registration.cpp.
TORCH_LIBRARY_FRAGMENT(deepspeed_cpp, m) {
  m.class_<deepspeed_cpp::GradientReducer>("GradientReducer")
      .def(
          torch::init<std::string, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                      std::vector<int64_t>, bool, std::string, std::string>())
      .def("lay_out_rank_major", &deepspeed_cpp::GradientReducer::lay_out_rank_major)
      .def("add_grad", &deepspeed_cpp::GradientReducer::add_grad)
      .def("finish", &deepspeed_cpp::GradientReducer::finish)
      .def("accumulate_into", &deepspeed_cpp::GradientReducer::accumulate_into)
      .def("set_overwrite", &deepspeed_cpp::GradientReducer::set_overwrite)
      .def("pending", &deepspeed_cpp::GradientReducer::pending)
      .def("harvested", &deepspeed_cpp::GradientReducer::harvested)
      .def("collective", &deepspeed_cpp::GradientReducer::collective)
      .def("held_bytes", &deepspeed_cpp::GradientReducer::held_bytes)
      .def("peak_held_bytes", &deepspeed_cpp::GradientReducer::peak_held_bytes)
      .def("spare_bytes", &deepspeed_cpp::GradientReducer::spare_bytes)
      .def("rank", &deepspeed_cpp::GradientReducer::rank)
      .def("world_size", &deepspeed_cpp::GradientReducer::world_size)
      .def("num_buckets", &deepspeed_cpp::GradientReducer::num_buckets)
      .def("device", &deepspeed_cpp::GradientReducer::device);
  m.class_<deepspeed_cpp::ReducerBuffersForTest>("ReducerBuffers")
      .def(torch::init<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                       std::vector<int64_t>, std::string>())
      .def("device", &deepspeed_cpp::ReducerBuffersForTest::device)
      .def("add_grad", &deepspeed_cpp::ReducerBuffersForTest::add_grad)
      .def("complete", &deepspeed_cpp::ReducerBuffersForTest::complete)
      .def("fill_missing", &deepspeed_cpp::ReducerBuffersForTest::fill_missing)
      .def("buffer", &deepspeed_cpp::ReducerBuffersForTest::buffer)
      .def("check_destination", &deepspeed_cpp::ReducerBuffersForTest::check_destination)
      .def("reset", &deepspeed_cpp::ReducerBuffersForTest::reset);
}
