// ATen glue of the MoE gating op on the CPU: checks, token ranges over threads, registration.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "gating_checks.h"
#include "gating_kernel.h"

namespace deepspeed_cpp {
namespace moe {
namespace {

// Tokens per parallel task: a token's work is O(experts), so small grains would cost more in
// scheduling than in arithmetic.
constexpr int64_t kTokenGrain = 512;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> moe_gating_cpu(
    const at::Tensor& logits_in, int64_t k, int64_t capacity,
    const std::optional<at::Tensor>& noise_in, const std::optional<at::Tensor>& priority_in) {
  const GatingShape shape = checked_gating_shape(logits_in, k, capacity, noise_in, priority_in);
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor noise = noise_in.has_value() ? noise_in->contiguous() : at::Tensor();
  const at::Tensor priority =
      priority_in.has_value() ? priority_in->to(at::kDouble).contiguous() : at::Tensor();
  const int64_t tokens = shape.num_tokens;
  const GatingOutputs out = allocate_gating_outputs(logits, shape, k);
  const at::Tensor &expert = out.expert, &position = out.position, &kept = out.kept;
  const at::Tensor &weight = out.weight, &slot_counts = out.slot_counts, &prob = out.prob;
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "moe_gating_cpu", [&] {
    const scalar_t* noise_data = noise.defined() ? noise.const_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, tokens, kTokenGrain, [&](int64_t begin, int64_t end) {
      route_tokens(logits.const_data_ptr<scalar_t>(), noise_data, shape, begin, end,
                   expert.mutable_data_ptr<int64_t>(), prob.mutable_data_ptr<scalar_t>());
    });
    assign_positions(expert.const_data_ptr<int64_t>(),
                     priority.defined() ? priority.const_data_ptr<double>() : nullptr, shape,
                     position.mutable_data_ptr<int64_t>(), kept.mutable_data_ptr<bool>(),
                     slot_counts.mutable_data_ptr<int64_t>());
    at::parallel_for(0, tokens, kTokenGrain, [&](int64_t begin, int64_t end) {
      combine_tokens(prob.const_data_ptr<scalar_t>(), kept.const_data_ptr<bool>(), shape.k, begin,
                     end, weight.mutable_data_ptr<scalar_t>());
    });
  });
  return {weight, expert, position, kept, slot_counts};
}

at::Tensor moe_gating_backward_cpu(const at::Tensor& grad_weight_in, const at::Tensor& logits_in,
                                   const at::Tensor& expert_in, const at::Tensor& kept_in) {
  const GatingShape shape = checked_backward_shape(grad_weight_in, logits_in, expert_in, kept_in);
  const at::Tensor grad_weight = grad_weight_in.contiguous();
  const at::Tensor logits = logits_in.contiguous();
  const at::Tensor expert = expert_in.contiguous();
  const at::Tensor kept = kept_in.contiguous();
  const int64_t* experts = expert.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < expert.numel(); ++i) {
    TORCH_CHECK(experts[i] >= 0 && experts[i] < shape.num_experts, "moe_gating_backward: expert[",
                i / shape.k, "][", i % shape.k, "] is ", experts[i],
                ", not an expert index in [0, ", shape.num_experts, ")");
  }
  at::Tensor grad_logits = at::empty_like(logits);
  AT_DISPATCH_FLOATING_TYPES(logits.scalar_type(), "moe_gating_backward_cpu", [&] {
    at::parallel_for(0, shape.num_tokens, kTokenGrain, [&](int64_t begin, int64_t end) {
      combine_tokens_backward(grad_weight.const_data_ptr<scalar_t>(),
                              logits.const_data_ptr<scalar_t>(), expert.const_data_ptr<int64_t>(),
                              kept.const_data_ptr<bool>(), shape, begin, end,
                              grad_logits.mutable_data_ptr<scalar_t>());
    });
  });
  return grad_logits;
}

}  // namespace
}  // namespace moe
}  // namespace deepspeed_cpp

TORCH_LIBRARY_IMPL(deepspeed_cpp, CPU, m) {
  m.impl("moe_gating", &deepspeed_cpp::moe::moe_gating_cpu);
  m.impl("moe_gating_backward", &deepspeed_cpp::moe::moe_gating_backward_cpu);
}
