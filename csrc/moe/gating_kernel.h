// The MoE gating op's CPU kernel, torch-free: raw pointers, sizes, token ranges (the ATen glue in
// gating_op.cpp splits tokens over threads). Row-major layouts: logits/noise/grad_logits
// [num_tokens, num_experts]; expert/prob/position/kept/weight/grad_weight [num_tokens, k];
// priority [num_tokens]; slot_counts [k, num_experts].
#pragma once

#include <cstdint>

namespace deepspeed_cpp {
namespace moe {

struct GatingShape {
  int64_t num_tokens;
  int64_t num_experts;
  int k;             // 1 or 2
  int64_t capacity;  // tokens an expert takes; < 0: no limit (no token is dropped)
};

// Experts and probabilities of tokens [begin, end).
template <typename T>
void route_tokens(const T* logits, const T* noise, const GatingShape& shape, int64_t begin,
                  int64_t end, int64_t* expert, T* prob);

// Capacity decisions, single-threaded (a scan in token order). Without priorities an expert's
// slots fill in token order, every first choice before any second choice (DeepSpeed's top-2
// offsets slot 1 by the expert's slot-0 count). With priorities (k = 1 only) the `capacity`
// tokens of highest priority (ties: lower token index) are kept. Either way a kept token's
// position is the number of kept tokens before it in token order for that expert (slot 0 first);
// a dropped one gets position -1. slot_counts counts choices before any drop.
void assign_positions(const int64_t* expert, const double* priority, const GatingShape& shape,
                      int64_t* position, bool* kept, int64_t* slot_counts);

// Combine weights of tokens [begin, end).
template <typename T>
void combine_tokens(const T* prob, const bool* kept, int k, int64_t begin, int64_t end, T* weight);

// Gradient w.r.t. the logits of tokens [begin, end), given the combine weights' gradient.
template <typename T>
void combine_tokens_backward(const T* grad_weight, const T* logits, const int64_t* expert,
                             const bool* kept, const GatingShape& shape, int64_t begin, int64_t end,
                             T* grad_logits);

}  // namespace moe
}  // namespace deepspeed_cpp
