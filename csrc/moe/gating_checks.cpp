#include "gating_checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

namespace deepspeed_cpp {
namespace moe {

namespace {

void check_logits(const char* op, const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2, op, ": logits must be 2-D [tokens, experts], got shape ",
              logits.sizes());
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kDouble, op,
              ": logits must be float32 or float64 (the gate runs in fp32, as DeepSpeed's), got ",
              logits.scalar_type());
  TORCH_CHECK(logits.size(1) >= 1, op, ": logits must have at least one expert column, got shape ",
              logits.sizes());
}

}  // namespace

GatingShape checked_gating_shape(const at::Tensor& logits, int64_t k, int64_t capacity,
                                 const std::optional<at::Tensor>& noise,
                                 const std::optional<at::Tensor>& priority) {
  check_logits("moe_gating", logits);
  TORCH_CHECK(k == 1 || k == 2, "moe_gating: k must be 1 or 2, got ", k);
  TORCH_CHECK(logits.size(1) >= k, "moe_gating: k=", k, " needs at least ", k,
              " experts, but logits has ", logits.size(1), " columns");
  if (noise.has_value()) {
    TORCH_CHECK(noise->sizes() == logits.sizes(), "moe_gating: noise must have the logits' shape ",
                logits.sizes(), ", got ", noise->sizes());
    TORCH_CHECK(noise->scalar_type() == logits.scalar_type(),
                "moe_gating: noise must have the logits' dtype ", logits.scalar_type(), ", got ",
                noise->scalar_type());
    TORCH_CHECK(noise->device() == logits.device(), "moe_gating: noise is on ", noise->device(),
                " but logits is on ", logits.device());
  }
  if (priority.has_value()) {
    TORCH_CHECK(k == 1,
                "moe_gating: priority (random token selection) is for k=1 only, as in DeepSpeed; "
                "got k=",
                k);
    TORCH_CHECK(priority->dim() == 1 && priority->size(0) == logits.size(0),
                "moe_gating: priority must be 1-D with one value per token (", logits.size(0),
                "), got shape ", priority->sizes());
    TORCH_CHECK(at::isFloatingType(priority->scalar_type()),
                "moe_gating: priority must be a floating tensor, got ", priority->scalar_type());
    TORCH_CHECK(priority->device() == logits.device(), "moe_gating: priority is on ",
                priority->device(), " but logits is on ", logits.device());
  }
  return GatingShape{logits.size(0), logits.size(1), static_cast<int>(k), capacity};
}

GatingOutputs allocate_gating_outputs(const at::Tensor& logits, const GatingShape& shape,
                                      int64_t k) {
  const int64_t tokens = shape.num_tokens;
  const at::TensorOptions indices = logits.options().dtype(at::kLong);
  return GatingOutputs{
      at::empty({tokens, k}, indices),
      at::empty({tokens, k}, indices),
      at::empty({tokens, k}, logits.options().dtype(at::kBool)),
      at::empty({tokens, k}, logits.options()),
      at::empty({k, shape.num_experts}, indices),
      at::empty({tokens, k}, logits.options()),
  };
}

GatingShape checked_backward_shape(const at::Tensor& grad_weight, const at::Tensor& logits,
                                   const at::Tensor& expert, const at::Tensor& kept) {
  check_logits("moe_gating_backward", logits);
  TORCH_CHECK(expert.dim() == 2 && expert.size(0) == logits.size(0) &&
                  (expert.size(1) == 1 || expert.size(1) == 2),
              "moe_gating_backward: expert must be [tokens, k] with k 1 or 2 and ", logits.size(0),
              " tokens, got shape ", expert.sizes());
  TORCH_CHECK(expert.scalar_type() == at::kLong, "moe_gating_backward: expert must be int64, got ",
              expert.scalar_type());
  TORCH_CHECK(kept.sizes() == expert.sizes() && kept.scalar_type() == at::kBool,
              "moe_gating_backward: kept must be a bool tensor of shape ", expert.sizes(), ", got ",
              kept.scalar_type(), " ", kept.sizes());
  TORCH_CHECK(
      grad_weight.sizes() == expert.sizes() && grad_weight.scalar_type() == logits.scalar_type(),
      "moe_gating_backward: grad_weight must be ", logits.scalar_type(), " of shape ",
      expert.sizes(), ", got ", grad_weight.scalar_type(), " ", grad_weight.sizes());
  for (const at::Tensor* t : {&grad_weight, &expert, &kept}) {
    TORCH_CHECK(t->device() == logits.device(), "moe_gating_backward: all tensors must be on ",
                logits.device(), ", got one on ", t->device());
  }
  return GatingShape{logits.size(0), logits.size(1), static_cast<int>(expert.size(1)), -1};
}

}  // namespace moe
}  // namespace deepspeed_cpp
