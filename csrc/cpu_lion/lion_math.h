// Lion's hyper-parameters and per-step constants (Chen et al., "Symbolic Discovery of
// Optimization Algorithms", 2023):
//   update = sign(beta1 * exp_avg + (1 - beta1) * grad)
//   param = param * (1 - lr * weight_decay) - lr * update
//   exp_avg = beta2 * exp_avg + (1 - beta2) * grad
#pragma once

namespace deepspeed_cpp {

struct LionHyperParams {
  double lr;
  double beta1;
  double beta2;
  double weight_decay;
};

// Folded once on the host in double precision and rounded to float.
struct LionCoefficients {
  float beta1;
  float one_minus_beta1;
  float beta2;
  float one_minus_beta2;
  float neg_lr;
  float decay_factor;  // 1 - lr * weight_decay
};

inline LionCoefficients make_lion_coefficients(const LionHyperParams& hp) {
  LionCoefficients c;
  c.beta1 = float(hp.beta1);
  c.one_minus_beta1 = float(1.0 - hp.beta1);
  c.beta2 = float(hp.beta2);
  c.one_minus_beta2 = float(1.0 - hp.beta2);
  c.neg_lr = float(-hp.lr);
  c.decay_factor = float(1.0 - hp.lr * hp.weight_decay);
  return c;
}

}  // namespace deepspeed_cpp
