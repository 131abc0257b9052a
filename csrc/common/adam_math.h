// The per-element Adam/AdamW update shared by every kernel (CPU ISA paths and CUDA).
//
// Bit-exactness contract: every path evaluates exactly these operations in exactly this order,
// with explicit fused multiply-adds (fmaf) and no other contraction. Sources that include this
// header are compiled with -ffp-contract=off (nvcc: --fmad=false) so that the compiler cannot fuse
// a*b+c on one path and not on another. sqrtf and '/' are correctly rounded IEEE operations on
// every target, so the scalar, AVX2, AVX-512 and CUDA results are bitwise equal.
#pragma once

#include <cmath>
#include <cstdint>

#include "host_device.h"

namespace deepspeed_cpp {

// Hyper-parameters of one Adam step, as the caller gives them.
struct AdamHyperParams {
  double lr;
  double beta1;
  double beta2;
  double eps;
  double weight_decay;
  int64_t step;  // 1-based step number after this update
  bool bias_correction;
  bool adamw_mode;  // true: decoupled weight decay (AdamW); false: L2 added to the gradient
};

// Per-step constants, folded once on the host in double precision and rounded to float.
struct AdamCoefficients {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float eps;
  float l2_weight_decay;            // weight decay added to the gradient (Adam mode), else 0
  float decay_factor;               // 1 - lr * weight_decay (AdamW mode), else 1
  float neg_step_size;              // -lr / (1 - beta1^step)
  float inv_sqrt_bias_correction2;  // 1 / sqrt(1 - beta2^step)
};

// The constants for learning rate `lr` at step `step`. They are arguments apart from `hp` so that
// the CUDA kernel can take them from device tensors; the device's pow may differ from the host's
// libm in the last bit of a double, which after rounding to float changes a coefficient rarely.
DS_HOST_DEVICE inline AdamCoefficients adam_coefficients(const AdamHyperParams& hp, double lr,
                                                         int64_t step) {
  const double bc1 = hp.bias_correction ? 1.0 - pow(hp.beta1, double(step)) : 1.0;
  const double bc2 = hp.bias_correction ? 1.0 - pow(hp.beta2, double(step)) : 1.0;
  AdamCoefficients c;
  c.beta1 = float(hp.beta1);
  c.one_minus_beta1 = float(1.0 - hp.beta1);
  c.beta2 = float(hp.beta2);
  c.one_minus_beta2 = float(1.0 - hp.beta2);
  c.eps = float(hp.eps);
  c.l2_weight_decay = hp.adamw_mode ? 0.0f : float(hp.weight_decay);
  c.decay_factor = hp.adamw_mode ? float(1.0 - lr * hp.weight_decay) : 1.0f;
  c.neg_step_size = float(-lr / bc1);
  c.inv_sqrt_bias_correction2 = float(1.0 / sqrt(bc2));
  return c;
}

inline AdamCoefficients make_adam_coefficients(const AdamHyperParams& hp) {
  return adam_coefficients(hp, hp.lr, hp.step);
}

// One element. Weight decay terms are applied unconditionally (they are exact no-ops at their
// neutral values 0 and 1) so that the loop body has no data-dependent branch and vectorises.
DS_HOST_DEVICE inline void adam_update_element(float& param, float grad, float& exp_avg,
                                               float& exp_avg_sq, const AdamCoefficients& c) {
  const float g = fmaf(c.l2_weight_decay, param, grad);
  const float m = fmaf(c.beta1, exp_avg, c.one_minus_beta1 * g);
  const float v = fmaf(c.beta2, exp_avg_sq, (c.one_minus_beta2 * g) * g);
  const float denom = fmaf(sqrtf(v), c.inv_sqrt_bias_correction2, c.eps);
  const float update = m / denom;
  param = fmaf(c.neg_step_size, update, param * c.decay_factor);
  exp_avg = m;
  exp_avg_sq = v;
}

}  // namespace deepspeed_cpp
