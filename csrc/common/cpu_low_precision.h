// bfloat16 / float16 storage for the CPU optimizer kernels, and its scalar conversions.
//
// Every conversion gives the same bits as torch's own contiguous Tensor.to() on x86 (which is
// what the vector paths compute with their instructions), so that the scalar path, the tails of
// the vector paths and every ISA level agree bit for bit:
// - float -> bfloat16: round to nearest, ties to even, on the bit pattern; overflow goes to
//   infinity, subnormals are rounded (not flushed); every NaN becomes 0xFFFF (torch's value).
// - float -> float16: IEEE round to nearest even (F16C's VCVTPS2PH); a NaN keeps its sign and
//   top payload bits and is made quiet.
// - bfloat16 -> float: exact (a shift). float16 -> float: exact; a NaN is made quiet (VCVTPH2PS).
// Header-only and free of target-specific code: it is compiled for the baseline ISA everywhere.
#pragma once

#include <cstdint>
#include <cstring>

namespace deepspeed_cpp {
namespace cpu_optim {

// Distinct types for the two 16-bit formats, so that overloads pick the right conversion.
struct BFloat16Bits {
  uint16_t bits;
};
struct Float16Bits {
  uint16_t bits;
};

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

inline float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
}

inline float load_as_float(const float* p) { return *p; }

inline float load_as_float(const BFloat16Bits* p) {
  return float_from_bits(uint32_t(p->bits) << 16);
}

inline float load_as_float(const Float16Bits* p) {
  const uint32_t h = p->bits;
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) {  // infinity, or NaN made quiet
    return float_from_bits(sign | 0x7f800000u | (mantissa != 0 ? 0x400000u : 0u) |
                           (mantissa << 13));
  }
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = float(mantissa) * 0x1p-24f;
    return float_from_bits(sign | float_bits(magnitude));
  }
  return float_from_bits(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

inline uint16_t round_to_bfloat16_bits(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0xffffu;  // NaN
  const uint32_t lowest_kept_bit = (bits >> 16) & 1u;
  return uint16_t((bits + 0x7fffu + lowest_kept_bit) >> 16);
}

inline uint16_t round_to_float16_bits(float value) {
  const uint32_t bits = float_bits(value);
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) {  // NaN: quiet, top payload bits kept
    return uint16_t(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
  }
  // 65520 is half-way between float16's largest finite value 65504 (odd mantissa) and 2^16:
  // it and everything above round to infinity.
  if (magnitude >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (magnitude >= 0x38800000u) {  // normal in float16 (>= 2^-14): rebias exponent, round even
    const uint32_t lowest_kept_bit = (magnitude >> 13) & 1u;
    return uint16_t(sign | ((magnitude - (112u << 23) + 0xfffu + lowest_kept_bit) >> 13));
  }
  // Subnormal or zero in float16. Adding 0.5 leaves a float whose last place is 2^-24, float16's
  // subnormal step, so the (correctly rounded, ties-to-even) addition does the rounding; the
  // result may carry into 0x400, the smallest normal, which is again the right encoding.
  const float shifted = float_from_bits(magnitude) + 0.5f;
  return uint16_t(sign | (float_bits(shifted) - 0x3f000000u));
}

inline void store_from_float(float* p, float value) { *p = value; }
inline void store_from_float(BFloat16Bits* p, float value) {
  p->bits = round_to_bfloat16_bits(value);
}
inline void store_from_float(Float16Bits* p, float value) {
  p->bits = round_to_float16_bits(value);
}

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
