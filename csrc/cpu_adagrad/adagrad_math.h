// Adagrad's hyper-parameters and per-step constants, as torch.optim.Adagrad defines the step:
//   clr = lr / (1 + (step - 1) * lr_decay);  g = grad + weight_decay * param
//   sum += g * g;  param -= clr * g / (sqrt(sum) + eps)
#pragma once

#include <cstdint>

namespace deepspeed_cpp {

struct AdagradHyperParams {
  double lr;
  double eps;
  double weight_decay;
  double lr_decay;
  int64_t step;  // 1-based step number after this update
};

// Folded once on the host in double precision and rounded to float.
struct AdagradCoefficients {
  float weight_decay;
  float eps;
  float neg_clr;  // -lr / (1 + (step - 1) * lr_decay)
};

inline AdagradCoefficients make_adagrad_coefficients(const AdagradHyperParams& hp) {
  AdagradCoefficients c;
  c.weight_decay = float(hp.weight_decay);
  c.eps = float(hp.eps);
  c.neg_clr = float(-hp.lr / (1.0 + double(hp.step - 1) * hp.lr_decay));
  return c;
}

}  // namespace deepspeed_cpp
