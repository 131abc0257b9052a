// The portable lane type of the CPU optimizer kernels: one float at a time.
//
// Every lane type (this one, cpu_simd_avx2.h, cpu_simd_avx512.h, cpu_simd_neon.h) offers the same
// operations, each a single correctly rounded IEEE operation (fma is fused, with one rounding), so
// that a formula written once over `typename Lanes::F` gives the same bits at every width. The
// contents sit in an unnamed namespace on purpose: these headers are compiled under a different
// target in each translation unit, and no two of them may share an out-of-line copy.
#pragma once

#include <cmath>
#include <cstdint>

#include "cpu_low_precision.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

struct ScalarLanes {
  using F = float;
  static constexpr int kWidth = 1;

  static F broadcast(float x) { return x; }
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F fma(F a, F b, F c) { return std::fmaf(a, b, c); }
  static F sqrt(F a) { return std::sqrt(a); }
  // -1, 0 or +1 like torch.sign; NaN stays NaN.
  static F sign(F a) { return a > 0.0f ? 1.0f : (a < 0.0f ? -1.0f : (a == 0.0f ? 0.0f : a)); }
  // Whether any lane of `a` is an infinity or a NaN.
  static bool any_nonfinite(F a) { return !std::isfinite(a); }

  template <class T>
  static F load(const T* p) {
    return load_as_float(p);
  }
  template <class T>
  static void store(T* p, F value) {
    store_from_float(p, value);
  }
};

}  // namespace
}  // namespace cpu_optim
}  // namespace deepspeed_cpp
