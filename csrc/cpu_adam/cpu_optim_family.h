// What csrc/cpu_optim/ compiles for the cpu_adam family (this folder is on the family's include
// path): its coefficients, and its lanes header, which each ISA source includes inside its target
// region so that the per-element step is compiled for that level.
#pragma once

#include "../common/adam_math.h"

#define DS_CPU_OPTIM_FAMILY_LANES "../cpu_adam/adam_lanes.h"
// The extern "C" function csrc/cpu_optim/cpu_optim_isa_query.cpp defines for this family.
#define DS_CPU_OPTIM_ISA_QUERY deepspeed_cpp_cpu_adam_isa

namespace deepspeed_cpp {
namespace cpu_optim {
using FamilyCoefficients = AdamCoefficients;
}  // namespace cpu_optim
}  // namespace deepspeed_cpp
