// The Adagrad step of the CPU kernel over a lane type (cpu_simd_*.h), for common/cpu_stream_loop.h.
// Written once over the lane operations, so every ISA level and the scalar tails round alike.
// Include only inside an ISA target region, after adagrad_math.h (see
// cpu_optim/cpu_optim_avx512.cpp).
#pragma once

#include "adagrad_math.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

struct AdagradKernel {
  static constexpr int kStates = 1;  // state_sum
  using Coefficients = AdagradCoefficients;

  template <class L>
  struct Lanes {
    explicit Lanes(const AdagradCoefficients& c)
        : weight_decay(L::broadcast(c.weight_decay)),
          eps(L::broadcast(c.eps)),
          neg_clr(L::broadcast(c.neg_clr)) {}
    typename L::F weight_decay, eps, neg_clr;
  };

  template <class L>
  __attribute__((always_inline)) static void update(typename L::F& param, typename L::F grad,
                                                    typename L::F* state, const Lanes<L>& c) {
    using F = typename L::F;
    const F g = L::fma(c.weight_decay, param, grad);
    const F sum = L::fma(g, g, state[0]);
    const F std_dev = L::add(L::sqrt(sum), c.eps);
    param = L::fma(c.neg_clr, L::div(g, std_dev), param);
    state[0] = sum;
  }
};

// What csrc/cpu_optim/'s ISA sources instantiate.
using FamilyKernel = AdagradKernel;

}  // namespace
}  // namespace cpu_optim
}  // namespace deepspeed_cpp
