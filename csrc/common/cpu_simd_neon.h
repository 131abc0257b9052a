// aarch64 Advanced SIMD lanes (4 floats) with the operations of cpu_simd_scalar.h.
// Advanced SIMD is part of the aarch64 base ISA, so no target region is needed.
#pragma once

#if defined(__aarch64__)

#include <arm_neon.h>

#include "cpu_low_precision.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

struct NeonLanes {
  using F = float32x4_t;
  static constexpr int kWidth = 4;

  static F broadcast(float x) { return vdupq_n_f32(x); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }  // c + a * b, one rounding
  static F sqrt(F a) { return vsqrtq_f32(a); }
  static F sign(F a) {
    const F zero = vdupq_n_f32(0.0f);
    const uint32x4_t positive =
        vandq_u32(vcgtq_f32(a, zero), vreinterpretq_u32_f32(vdupq_n_f32(1.0f)));
    const uint32x4_t negative =
        vandq_u32(vcltq_f32(a, zero), vreinterpretq_u32_f32(vdupq_n_f32(-1.0f)));
    const F result = vreinterpretq_f32_u32(vorrq_u32(positive, negative));
    return vbslq_f32(vceqq_f32(a, a), result, a);  // NaN lanes keep a
  }
  static bool any_nonfinite(F a) {
    const F difference = vsubq_f32(a, a);
    return vminvq_u32(vceqq_f32(difference, difference)) == 0;
  }

  static F load(const float* p) { return vld1q_f32(p); }
  static F load(const BFloat16Bits* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p)), 16));
  }
  static F load(const Float16Bits* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(reinterpret_cast<const uint16_t*>(p))));
  }

  static void store(float* p, F value) { vst1q_f32(p, value); }
  static void store(BFloat16Bits* p, F value) {
    const uint32x4_t bits = vreinterpretq_u32_f32(value);
    const uint32x4_t lowest_kept_bit = vandq_u32(vshrq_n_u32(bits, 16), vdupq_n_u32(1));
    uint32x4_t rounded =
        vshrq_n_u32(vaddq_u32(vaddq_u32(bits, vdupq_n_u32(0x7fff)), lowest_kept_bit), 16);
    rounded = vbslq_u32(vceqq_f32(value, value), rounded, vdupq_n_u32(0xffff));
    vst1_u16(reinterpret_cast<uint16_t*>(p), vmovn_u32(rounded));
  }
  static void store(Float16Bits* p, F value) {
    vst1_u16(reinterpret_cast<uint16_t*>(p), vreinterpret_u16_f16(vcvt_f16_f32(value)));
  }
};

}  // namespace
}  // namespace cpu_optim
}  // namespace deepspeed_cpp

#endif  // __aarch64__
