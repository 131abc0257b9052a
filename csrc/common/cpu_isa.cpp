#include "cpu_isa.h"

#include <cstdlib>
#include <stdexcept>

namespace deepspeed_cpp {
namespace {

CpuIsa best_supported_isa() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return CpuIsa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kScalar;
}

CpuIsa parse_isa(const std::string& name) {
  if (name == "scalar") return CpuIsa::kScalar;
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "avx512") return CpuIsa::kAvx512;
  throw std::invalid_argument("DS_CPU_ISA='" + name +
                              "' is not a known level; expected one of scalar, avx2, avx512");
}

CpuIsa decide_isa() {
  const CpuIsa best = best_supported_isa();
  const char* forced = std::getenv("DS_CPU_ISA");
  if (forced == nullptr || *forced == '\0') return best;
  const CpuIsa wanted = parse_isa(forced);
  if (static_cast<int>(wanted) > static_cast<int>(best)) {
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
