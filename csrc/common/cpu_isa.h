// Run-time choice of the CPU instruction-set level used by the CPU kernels.
#pragma once

#include <string>

namespace deepspeed_cpp {

enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// The best level this CPU supports, lowered to DS_CPU_ISA (scalar|avx2|avx512) when that is set.
// Decided once per process. Asking DS_CPU_ISA for a level the CPU lacks throws.
CpuIsa selected_cpu_isa();

const char* cpu_isa_name(CpuIsa isa);

}  // namespace deepspeed_cpp
