// Argument checks of the MoE gating ops, shared by the CPU and the CUDA glue.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "gating_kernel.h"

namespace deepspeed_cpp {
namespace moe {

// Checks moe_gating's arguments (naming the bad one) and returns the problem's shape.
GatingShape checked_gating_shape(const at::Tensor& logits, int64_t k, int64_t capacity,
                                 const std::optional<at::Tensor>& noise,
                                 const std::optional<at::Tensor>& priority);

// The tensors one moe_gating call writes: the op's five outputs and the per-slot gate
// probabilities the combine step reads (a temporary of the op).
struct GatingOutputs {
  at::Tensor expert;       // [tokens, k] int64: the chosen expert of each slot
  at::Tensor position;     // [tokens, k] int64: the slot's place in its expert's capacity
  at::Tensor kept;         // [tokens, k] bool: whether the slot fits in its expert's capacity
  at::Tensor weight;       // [tokens, k] logits' dtype: the combine weight
  at::Tensor slot_counts;  // [k, experts] int64: tokens routed to each expert per slot
  at::Tensor prob;         // [tokens, k] logits' dtype: the gate probability of each slot
};

// Allocates (uninitialised, on the logits' device) every tensor moe_gating writes, so that the
// CPU and CUDA glue cannot disagree on a shape or dtype.
GatingOutputs allocate_gating_outputs(const at::Tensor& logits, const GatingShape& shape,
                                      int64_t k);

// Checks moe_gating_backward's arguments against the forward's outputs.
GatingShape checked_backward_shape(const at::Tensor& grad_weight, const at::Tensor& logits,
                                   const at::Tensor& expert, const at::Tensor& kept);

}  // namespace moe
}  // namespace deepspeed_cpp
