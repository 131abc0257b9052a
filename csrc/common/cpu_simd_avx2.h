// AVX2 + FMA + F16C lanes (8 floats) with the operations of cpu_simd_scalar.h.
// Include only inside a region compiled for those features (see cpu_simd_target.h).
#pragma once

#include <immintrin.h>

#include "cpu_low_precision.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

struct Avx2Lanes {
  using F = __m256;
  static constexpr int kWidth = 8;

  static F broadcast(float x) { return _mm256_set1_ps(x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F sign(F a) {
    const F zero = _mm256_setzero_ps();
    const F positive = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const F negative = _mm256_and_ps(_mm256_cmp_ps(a, zero, _CMP_LT_OQ), _mm256_set1_ps(-1.0f));
    return _mm256_blendv_ps(_mm256_or_ps(positive, negative), a, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
  }
  static bool any_nonfinite(F a) {
    // a - a is 0 for finite lanes and NaN for infinite or NaN ones.
    const F difference = _mm256_sub_ps(a, a);
    return _mm256_movemask_ps(_mm256_cmp_ps(difference, difference, _CMP_UNORD_Q)) != 0;
  }

  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const BFloat16Bits* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static F load(const Float16Bits* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  static void store(float* p, F value) { _mm256_storeu_ps(p, value); }
  static void store(BFloat16Bits* p, F value) {
    // Same integer rounding as round_to_bfloat16_bits, eight lanes at a time.
    const __m256i bits = _mm256_castps_si256(value);
    const __m256i lowest_kept_bit =
        _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lowest_kept_bit), 16);
    const __m256 is_nan = _mm256_cmp_ps(value, value, _CMP_UNORD_Q);
    rounded = _mm256_castps_si256(_mm256_blendv_ps(
        _mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0xffff)), is_nan));
    // Every lane is in [0, 0xffff], so the saturating pack is exact; it packs per 128-bit half.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static void store(Float16Bits* p, F value) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

}  // namespace
}  // namespace cpu_optim
}  // namespace deepspeed_cpp
