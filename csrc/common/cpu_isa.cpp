#include "cpu_isa.h"

#include <cstdlib>
#include <stdexcept>

namespace deepspeed_cpp {
namespace {

CpuIsa best_supported_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  // F16C comes with every AVX2 CPU; it is checked because the avx2 path converts float16 with it.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  // The avx512 level is compiled for F, BW, VL and DQ (every AVX-512 server CPU since Skylake;
  // the Xeon Phi line has F without BW/VL/DQ and takes the avx2 level).
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (avx512) return CpuIsa::kAvx512;
  if (avx2) return CpuIsa::kAvx2;
#elif defined(__aarch64__)
  return CpuIsa::kNeon;  // Advanced SIMD is part of the aarch64 base architecture.
#endif
  return CpuIsa::kScalar;
}

// The levels this architecture has, for DS_CPU_ISA.
bool belongs_to_this_architecture(CpuIsa isa) {
#if defined(__x86_64__)
  return isa != CpuIsa::kNeon;
#elif defined(__aarch64__)
  return isa == CpuIsa::kScalar || isa == CpuIsa::kNeon;
#else
  return isa == CpuIsa::kScalar;
#endif
}

CpuIsa parse_isa(const std::string& name) {
  if (name == "scalar") return CpuIsa::kScalar;
  if (name == "neon") return CpuIsa::kNeon;
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "avx512") return CpuIsa::kAvx512;
  throw std::invalid_argument("DS_CPU_ISA='" + name +
                              "' is not a known level; expected one of scalar, avx2, avx512, neon");
}

CpuIsa decide_isa() {
  const CpuIsa best = best_supported_isa();
  const char* forced = std::getenv("DS_CPU_ISA");
  if (forced == nullptr || *forced == '\0') return best;
  const CpuIsa wanted = parse_isa(forced);
  if (!belongs_to_this_architecture(wanted) || static_cast<int>(wanted) > static_cast<int>(best)) {
    throw std::invalid_argument(std::string("DS_CPU_ISA='") + forced +
                                "' asks for a level this CPU does not support; the best it "
                                "supports is '" +
                                cpu_isa_name(best) + "'");
  }
  return wanted;
}

}  // namespace

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kNeon:
      return "neon";
    case CpuIsa::kScalar:
      return "scalar";
  }
  return "unknown";
}

CpuIsa selected_cpu_isa() {
  static const CpuIsa isa = decide_isa();
  return isa;
}

}  // namespace deepspeed_cpp
