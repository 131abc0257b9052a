// ATen glue of the MoE gating op on CUDA: the same checks as the CPU op, then the kernels of
// gating_kernel.cu on the current stream (no host synchronisation).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "gating_checks.h"
#include "gating_cuda.h"

namespace deepspeed_cpp {
namespace moe {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_gating_cuda(
    const at::Tensor& logits_in, int64_t k, int64_t capacity,
    const std::optional<at::Tensor>& noise_in, const std::optional<at::Tensor>& priority_in) {
  const GatingShape shape = checked_gating_shape(logits_in, k, capacity, noise_in, priority_in);
  const c10::cuda::CUDAGuard device_guard(logits_in.device());
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor noise = noise_in.has_value() ? noise_in->contiguous() : at::Tensor();
  const at::Tensor priority =
      priority_in.has_value() ? priority_in->to(at::kDouble).contiguous() : at::Tensor();
  const GatingOutputs out = allocate_gating_outputs(logits, shape, k);
  const at::Tensor &expert = out.expert, &position = out.position, &kept = out.kept;
  const at::Tensor &weight = out.weight, &slot_counts = out.slot_counts, &prob = out.prob;
  const std::string error = launch_moe_gating_cuda(
      logits.const_data_ptr(), noise.defined() ? noise.const_data_ptr() : nullptr,
      priority.defined() ? priority.const_data_ptr<double>() : nullptr,
      logits.scalar_type() == at::kDouble, shape, expert.mutable_data_ptr<int64_t>(),
      prob.mutable_data_ptr(), position.mutable_data_ptr<int64_t>(), kept.mutable_data_ptr<bool>(),
      slot_counts.mutable_data_ptr<int64_t>(), weight.mutable_data_ptr(),
      c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error.empty(), "moe_gating: kernel launch failed: ", error);
  return {weight, expert, position, kept, slot_counts};
}

at::Tensor moe_gating_backward_cuda(const at::Tensor& grad_weight_in, const at::Tensor& logits_in,
                                    const at::Tensor& expert_in, const at::Tensor& kept_in) {
  const GatingShape shape = checked_backward_shape(grad_weight_in, logits_in, expert_in, kept_in);
  const c10::cuda::CUDAGuard device_guard(logits_in.device());
  const at::Tensor grad_weight = grad_weight_in.contiguous();
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor expert = expert_in.contiguous();
  const at::Tensor kept = kept_in.contiguous();
  at::Tensor grad_logits = at::empty_like(logits);
  const std::string error = launch_moe_gating_backward_cuda(
      grad_weight.const_data_ptr(), logits.const_data_ptr(), expert.const_data_ptr<int64_t>(),
      kept.const_data_ptr<bool>(), logits.scalar_type() == at::kDouble, shape,
      grad_logits.mutable_data_ptr(), c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error.empty(), "moe_gating_backward: kernel launch failed: ", error);
  return grad_logits;
}

}  // namespace
}  // namespace moe
}  // namespace deepspeed_cpp

TORCH_LIBRARY_IMPL(deepspeed_cpp, CUDA, m) {
  m.impl("moe_gating", &deepspeed_cpp::moe::moe_gating_cuda);
  m.impl("moe_gating_backward", &deepspeed_cpp::moe::moe_gating_backward_cuda);
}
