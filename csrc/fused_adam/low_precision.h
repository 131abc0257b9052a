// bfloat16 and float16 storage, converted to and from float by integer arithmetic only.
//
// Why not the hardware conversions on the device: the fused kernel must give the same bits on the
// GPU as its body gives on the CPU, where it is tested. These conversions are written once, with
// no floating-point operation in them, so both sides run literally the same code. Both round to
// nearest, ties to even, and treat NaN like torch's own Tensor.to(bfloat16 / float16) on the CPU
// (bfloat16: 0xFFFF; float16: quiet, sign and top payload bits kept) and like the CPU kernels'
// common/cpu_low_precision.h: the tests compare them bit for bit with torch, NaN included.
#pragma once

#include <cstdint>
#include <cstring>

#include "../common/host_device.h"

namespace deepspeed_cpp {

// Distinct types for the two 16-bit formats, so that overloads pick the right conversion.
struct BFloat16Bits {
  uint16_t bits;
};
struct Float16Bits {
  uint16_t bits;
};

DS_HOST_DEVICE inline uint32_t float_to_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

DS_HOST_DEVICE inline float bits_to_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

// Drops the low `shift` bits of `value` (1 <= shift <= 31), rounding to nearest, ties to even.
DS_HOST_DEVICE inline uint32_t shift_right_round_even(uint32_t value, int shift) {
  const uint32_t kept = value >> shift;
  const uint32_t dropped = value & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  return kept + ((dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u);
}

DS_HOST_DEVICE inline float load_as_float(float value) { return value; }

DS_HOST_DEVICE inline float load_as_float(BFloat16Bits value) {
  return bits_to_float(uint32_t(value.bits) << 16);
}

DS_HOST_DEVICE inline float load_as_float(Float16Bits value) {
  const uint32_t sign = uint32_t(value.bits & 0x8000u) << 16;
  const uint32_t exponent = (value.bits >> 10) & 0x1Fu;
  const uint32_t mantissa = value.bits & 0x3FFu;
  if (exponent == 0x1Fu) {  // infinity, or NaN made quiet
    const uint32_t quiet = mantissa != 0 ? 0x400000u : 0u;
    return bits_to_float(sign | 0x7F800000u | quiet | (mantissa << 13));
  }
  if (exponent != 0) {  // normal: rebias the exponent from 15 to 127
    return bits_to_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
  }
  if (mantissa == 0) {
    return bits_to_float(sign);
  }
  // Subnormal half: mantissa * 2^-24. Normalise it into a float with an explicit exponent.
  int shift = 0;
  uint32_t normalised = mantissa;
  while ((normalised & 0x400u) == 0) {
    normalised <<= 1;
    ++shift;
  }
  return bits_to_float(sign | (uint32_t(113 - shift) << 23) | ((normalised & 0x3FFu) << 13));
}

DS_HOST_DEVICE inline void store_from_float(float& out, float value) { out = value; }

DS_HOST_DEVICE inline void store_from_float(BFloat16Bits& out, float value) {
  const uint32_t bits = float_to_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) {
    out.bits = 0xFFFFu;  // what torch's CPU conversion gives for every NaN
    return;
  }
  // Rounding may carry into the exponent; the largest finite values correctly become infinity.
  out.bits = uint16_t(shift_right_round_even(bits, 16));
}

DS_HOST_DEVICE inline void store_from_float(Float16Bits& out, float value) {
  const uint32_t bits = float_to_bits(value);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  if (magnitude > 0x7F800000u) {
    out.bits = uint16_t(sign | 0x7E00u | ((magnitude >> 13) & 0x3FFu));  // quiet, payload kept
    return;
  }
  if (magnitude >= 0x477FF000u) {  // >= 65520: rounds beyond 65504, the largest finite half
    out.bits = uint16_t(sign | 0x7C00u);
    return;
  }
  if (magnitude >= 0x38800000u) {  // >= 2^-14: normal half; rounding may carry into the exponent
    out.bits = uint16_t(sign | shift_right_round_even(magnitude - 0x38000000u, 13));
    return;
  }
  // Subnormal half (or zero): the value in units of 2^-24, rounded. With the float's implicit bit
  // made explicit, value = significand * 2^(exponent - 150), so units = significand >> shift.
  const int exponent = int(magnitude >> 23);
  const int shift = 126 - exponent;
  if (shift > 24) {  // below half of the smallest subnormal half: rounds to zero
    out.bits = sign;
    return;
  }
  const uint32_t significand = (magnitude & 0x7FFFFFu) | 0x800000u;
  out.bits = uint16_t(sign | shift_right_round_even(significand, shift));
}

}  // namespace deepspeed_cpp
