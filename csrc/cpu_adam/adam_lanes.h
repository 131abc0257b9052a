// The Adam step of the CPU kernel over a lane type (cpu_simd_*.h), for common/cpu_stream_loop.h.
//
// One float at a time it is adam_update_element itself (adam_math.h, shared with the CUDA
// kernel); over vector lanes it is the same operations in the same order, each lane rounding
// exactly as adam_update_element does. tests/test_cpu_adam_op.py checks the levels bit for bit.
// Include only inside an ISA target region, after adam_math.h (see cpu_optim/cpu_optim_avx512.cpp).
#pragma once

#include <type_traits>

#include "../common/adam_math.h"
#include "../common/cpu_simd_scalar.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

struct AdamKernel {
  static constexpr int kStates = 2;  // exp_avg, exp_avg_sq
  using Coefficients = AdamCoefficients;

  // The coefficients broadcast to lanes once per range.
  template <class L>
  struct Lanes {
    using F = typename L::F;
    explicit Lanes(const AdamCoefficients& c)
        : scalar(c),
          beta1(L::broadcast(c.beta1)),
          one_minus_beta1(L::broadcast(c.one_minus_beta1)),
          beta2(L::broadcast(c.beta2)),
          one_minus_beta2(L::broadcast(c.one_minus_beta2)),
          eps(L::broadcast(c.eps)),
          l2_weight_decay(L::broadcast(c.l2_weight_decay)),
          decay_factor(L::broadcast(c.decay_factor)),
          neg_step_size(L::broadcast(c.neg_step_size)),
          inv_sqrt_bias_correction2(L::broadcast(c.inv_sqrt_bias_correction2)) {}
    AdamCoefficients scalar;
    F beta1, one_minus_beta1, beta2, one_minus_beta2, eps, l2_weight_decay, decay_factor,
        neg_step_size, inv_sqrt_bias_correction2;
  };

  template <class L>
  __attribute__((always_inline)) static void update(typename L::F& param, typename L::F grad,
                                                    typename L::F* state, const Lanes<L>& c) {
    using F = typename L::F;
    if constexpr (std::is_same_v<L, ScalarLanes>) {
      adam_update_element(param, grad, state[0], state[1], c.scalar);
    } else {
      // adam_update_element, lane by lane.
      const F g = L::fma(c.l2_weight_decay, param, grad);
      const F m = L::fma(c.beta1, state[0], L::mul(c.one_minus_beta1, g));
      const F v = L::fma(c.beta2, state[1], L::mul(L::mul(c.one_minus_beta2, g), g));
      const F denom = L::fma(L::sqrt(v), c.inv_sqrt_bias_correction2, c.eps);
      const F update = L::div(m, denom);
      param = L::fma(c.neg_step_size, update, L::mul(param, c.decay_factor));
      state[0] = m;
      state[1] = v;
    }
  }
};

// What csrc/cpu_optim/'s ISA sources instantiate.
using FamilyKernel = AdamKernel;

}  // namespace
}  // namespace cpu_optim
}  // namespace deepspeed_cpp
