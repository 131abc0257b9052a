// Run-time choice of the CPU instruction-set level used by the CPU kernels.
#pragma once

#include <string>

namespace deepspeed_cpp {

// Levels of one architecture are ordered: a higher level may use everything of a lower one.
// x86-64: scalar < avx2 (AVX2 + FMA + F16C) < avx512 (AVX-512F). aarch64: scalar < neon.
enum class CpuIsa { kScalar = 0, kNeon = 1, kAvx2 = 2, kAvx512 = 3 };

// The best level this CPU supports, lowered to DS_CPU_ISA (scalar|avx2|avx512|neon) when that is
// set. Decided once per process. Asking DS_CPU_ISA for a level the CPU lacks, or one of another
// architecture, throws std::invalid_argument naming the value and what this CPU supports.
CpuIsa selected_cpu_isa();

const char* cpu_isa_name(CpuIsa isa);

}  // namespace deepspeed_cpp
