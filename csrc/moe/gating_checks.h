// Argument checks of the MoE gating ops, shared by the CPU and the CUDA glue.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "gating_kernel.h"

namespace deepspeed_cpp {
namespace moe {

// Checks moe_gating's arguments (naming the bad one) and returns the problem's shape.
GatingShape checked_gating_shape(const at::Tensor& logits, int64_t k, int64_t capacity,
                                 const std::optional<at::Tensor>& noise,
                                 const std::optional<at::Tensor>& priority);

// Checks moe_gating_backward's arguments against the forward's outputs.
GatingShape checked_backward_shape(const at::Tensor& grad_weight, const at::Tensor& logits,
                                   const at::Tensor& expert, const at::Tensor& kept);

}  // namespace moe
}  // namespace deepspeed_cpp
