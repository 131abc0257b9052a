// The Lion step of the CPU kernel over a lane type (cpu_simd_*.h), for common/cpu_stream_loop.h.
// Written once over the lane operations, so every ISA level and the scalar tails round alike.
// Include only inside an ISA target region, after lion_math.h (see cpu_optim/cpu_optim_avx512.cpp).
#pragma once

#include "lion_math.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

struct LionKernel {
  static constexpr int kStates = 1;  // exp_avg
  using Coefficients = LionCoefficients;

  template <class L>
  struct Lanes {
    explicit Lanes(const LionCoefficients& c)
        : beta1(L::broadcast(c.beta1)),
          one_minus_beta1(L::broadcast(c.one_minus_beta1)),
          beta2(L::broadcast(c.beta2)),
          one_minus_beta2(L::broadcast(c.one_minus_beta2)),
          neg_lr(L::broadcast(c.neg_lr)),
          decay_factor(L::broadcast(c.decay_factor)) {}
    typename L::F beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, decay_factor;
  };

  template <class L>
  __attribute__((always_inline)) static void update(typename L::F& param, typename L::F grad,
                                                    typename L::F* state, const Lanes<L>& c) {
    using F = typename L::F;
    const F interpolated = L::fma(c.beta1, state[0], L::mul(c.one_minus_beta1, grad));
    param = L::fma(c.neg_lr, L::sign(interpolated), L::mul(param, c.decay_factor));
    state[0] = L::fma(c.beta2, state[0], L::mul(c.one_minus_beta2, grad));
  }
};

// What csrc/cpu_optim/'s ISA sources instantiate.
using FamilyKernel = LionKernel;

}  // namespace
}  // namespace cpu_optim
}  // namespace deepspeed_cpp
