// AVX-512F lanes (16 floats) with the operations of cpu_simd_scalar.h.
// Include only inside a region compiled for AVX-512F (see cpu_simd_target.h).
//
// bfloat16 is rounded with integer operations rather than AVX512-BF16's VCVTNEPS2BF16: that
// instruction flushes subnormal inputs to zero and keeps NaN payloads, so it would differ from
// tensor.to(torch.bfloat16) and from the other ISA levels. The rounding costs a few integer
// operations per 16 elements in a kernel bound by memory (see benchmarks/bench_cpu_adam.py).
#pragma once

#include <immintrin.h>

#include "cpu_low_precision.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

struct Avx512Lanes {
  using F = __m512;
  static constexpr int kWidth = 16;

  static F broadcast(float x) { return _mm512_set1_ps(x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F sign(F a) {
    const F zero = _mm512_setzero_ps();
    F result = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, zero, _CMP_GT_OQ), _mm512_set1_ps(1.0f));
    result =
        _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(a, zero, _CMP_LT_OQ), _mm512_set1_ps(-1.0f));
    return _mm512_mask_mov_ps(result, _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), a);
  }
  static bool any_nonfinite(F a) {
    const F difference = _mm512_sub_ps(a, a);  // NaN exactly where a is infinite or NaN
    return _mm512_cmp_ps_mask(difference, difference, _CMP_UNORD_Q) != 0;
  }

  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const BFloat16Bits* p) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static F load(const Float16Bits* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }

  static void store(float* p, F value) { _mm512_storeu_ps(p, value); }
  static void store(BFloat16Bits* p, F value) {
    // Same integer rounding as round_to_bfloat16_bits, sixteen lanes at a time.
    const __m512i bits = _mm512_castps_si512(value);
    const __m512i lowest_kept_bit =
        _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lowest_kept_bit), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q),
                                    _mm512_set1_epi32(0xffff));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(rounded));
  }
  static void store(Float16Bits* p, F value) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace
}  // namespace cpu_optim
}  // namespace deepspeed_cpp
