// The per-token arithmetic of the MoE gating op, shared by the CPU kernel (gating_kernel.cpp) and
// the CUDA kernel (gating_kernel.cu): choosing a token's experts, its combine weights once the
// capacity decisions are known, and the gradient of those weights w.r.t. the token's logits.
//
// Semantics follow DeepSpeed's top1gating/top2gating (deepspeed/moe/sharded_moe.py):
// - the gate probabilities are softmax(logits) over the experts;
// - slot 0 takes the expert with the largest logit; for k = 2, slot 1 takes the largest among the
//   others. `noise` (Gumbel samples drawn by the caller) is added to the logits when choosing the
//   last slot only: top-1 RSample, top-2 second-expert sampling. The probabilities never see it;
// - ties go to the lower expert index, as torch.argmax does (strict '>' below);
// - top-1 combine weight: the kept token's probability; top-2: the kept probabilities divided by
//   their sum, clamped below at the dtype's epsilon (a token that kept nothing gets zeros).
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"

namespace deepspeed_cpp {
namespace moe {

// The largest k handled; slots are small fixed arrays so that the body needs no allocation.
constexpr int kMaxSlots = 2;

DS_HOST_DEVICE inline float gating_exp(float x) { return expf(x); }
DS_HOST_DEVICE inline double gating_exp(double x) { return exp(x); }
// torch.finfo(dtype).eps, the clamp of the top-2 denominator (a literal: std::numeric_limits is
// not callable from device code without --expt-relaxed-constexpr).
DS_HOST_DEVICE inline float gating_epsilon(float) { return 1.1920928955078125e-07f; }
DS_HOST_DEVICE inline double gating_epsilon(double) { return 2.220446049250313080847e-16; }

// max and sum of exp(logit - max) of one row: the softmax's normaliser.
template <typename T>
struct SoftmaxRow {
  T max_logit;
  T sum;
  DS_HOST_DEVICE T prob(T logit) const { return gating_exp(logit - max_logit) / sum; }
};

template <typename T>
DS_HOST_DEVICE inline SoftmaxRow<T> softmax_row(const T* logits, int64_t num_experts) {
  SoftmaxRow<T> row{logits[0], T(0)};
  for (int64_t e = 1; e < num_experts; ++e) {
    row.max_logit = logits[e] > row.max_logit ? logits[e] : row.max_logit;
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    row.sum += gating_exp(logits[e] - row.max_logit);
  }
  return row;
}

// Chooses the token's k experts (expert[0..k)) and returns their probabilities (prob[0..k)).
// `noise` is this token's row of noise, or nullptr.
template <typename T>
DS_HOST_DEVICE inline void route_token(const T* logits, const T* noise, int64_t num_experts, int k,
                                       int64_t* expert, T* prob) {
  const SoftmaxRow<T> row = softmax_row(logits, num_experts);
  for (int slot = 0; slot < k; ++slot) {
    const bool noisy = noise != nullptr && slot == k - 1;
    int64_t best = -1;
    T best_score = T(0);
    for (int64_t e = 0; e < num_experts; ++e) {
      bool taken = false;
      for (int previous = 0; previous < slot; ++previous) {
        taken = taken || expert[previous] == e;
      }
      if (taken) {
        continue;
      }
      const T score = noisy ? logits[e] + noise[e] : logits[e];
      if (best < 0 || score > best_score) {
        best = e;
        best_score = score;
      }
    }
    expert[slot] = best;
    prob[slot] = row.prob(logits[best]);
  }
}

// Whether token `a` (priority pa) goes before token `b` (priority pb) when an expert keeps its
// `capacity` tokens of highest priority: higher priority first, ties to the lower token index. A
// NaN ranks above every number, as torch.sort and torch.topk order it; without that rule the
// order would not be a strict weak ordering (std::nth_element's requirement, undefined behaviour
// otherwise) and the CUDA count of tokens ahead would keep every NaN token past the capacity.
DS_HOST_DEVICE inline bool priority_before(double pa, int64_t a, double pb, int64_t b) {
  const bool a_nan = pa != pa;
  const bool b_nan = pb != pb;
  if (a_nan != b_nan) return a_nan;
  if (!a_nan && pa != pb) return pa > pb;
  return a < b;
}

// The combine weights of one token from its probabilities and which slots kept their capacity.
template <typename T>
DS_HOST_DEVICE inline void combine_token(const T* prob, const bool* kept, int k, T* weight) {
  if (k == 1) {
    weight[0] = kept[0] ? prob[0] : T(0);
    return;
  }
  const T a = kept[0] ? prob[0] : T(0);
  const T b = kept[1] ? prob[1] : T(0);
  T denom = a + b;
  denom = denom < gating_epsilon(T(0)) ? gating_epsilon(T(0)) : denom;
  weight[0] = a / denom;
  weight[1] = b / denom;
}

// d(loss)/d(logits) of one token given d(loss)/d(weight[slot]). With c_s = dloss/dp_s * p_s,
// d(loss)/d(logit_j) = sum_s [j == expert_s] c_s - p_j * sum_s c_s (softmax's Jacobian).
template <typename T>
DS_HOST_DEVICE inline void combine_token_backward(const T* grad_weight, const T* logits,
                                                  int64_t num_experts, const int64_t* expert,
                                                  const bool* kept, int k, T* grad_logits) {
  for (int slot = 0; slot < k; ++slot) {
    if (expert[slot] < 0 || expert[slot] >= num_experts) {
      // Not an index this op produced. The CPU op refuses it by name before calling this; the
      // CUDA op checks nothing on the host (no synchronisation), so the row is made NaN rather
      // than read out of bounds or left silently wrong.
      for (int64_t e = 0; e < num_experts; ++e) grad_logits[e] = T(NAN);
      return;
    }
  }
  const SoftmaxRow<T> row = softmax_row(logits, num_experts);
  T prob[kMaxSlots];
  T grad_prob[kMaxSlots];
  for (int slot = 0; slot < k; ++slot) {
    prob[slot] = row.prob(logits[expert[slot]]);
  }
  if (k == 1) {
    grad_prob[0] = kept[0] ? grad_weight[0] : T(0);
  } else {
    const T a = kept[0] ? prob[0] : T(0);
    const T b = kept[1] ? prob[1] : T(0);
    const T sum = a + b;
    if (sum < gating_epsilon(T(0))) {
      // The clamped denominator is a constant: the weights are linear in a and b.
      grad_prob[0] = grad_weight[0] / gating_epsilon(T(0));
      grad_prob[1] = grad_weight[1] / gating_epsilon(T(0));
    } else {
      const T shared = (grad_weight[0] * a + grad_weight[1] * b) / (sum * sum);
      grad_prob[0] = grad_weight[0] / sum - shared;
      grad_prob[1] = grad_weight[1] / sum - shared;
    }
    grad_prob[0] = kept[0] ? grad_prob[0] : T(0);
    grad_prob[1] = kept[1] ? grad_prob[1] : T(0);
  }
  T total = T(0);
  for (int slot = 0; slot < k; ++slot) {
    total += grad_prob[slot] * prob[slot];
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    T own = T(0);
    for (int slot = 0; slot < k; ++slot) {
      own += expert[slot] == e ? grad_prob[slot] * prob[slot] : T(0);
    }
    grad_logits[e] = own - row.prob(logits[e]) * total;
  }
}

}  // namespace moe
}  // namespace deepspeed_cpp
