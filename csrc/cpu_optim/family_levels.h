// The per-ISA loops of one CPU optimizer family, and the step that picks among them.
//
// cpu_adam, cpu_adagrad and cpu_lion each compile the same sources in csrc/cpu_optim/ (one per
// ISA level plus cpu_optim_dispatch.cpp) with their own folder on the include path, where
// <cpu_optim_family.h> names the family's coefficients and its lanes header: the family's
// per-element step is the only thing that differs. Only the level selected at run time
// (common/cpu_isa.h) may be called: the others may contain instructions this CPU lacks.
#pragma once

#include <cpu_optim_family.h>

#include <vector>

#include "../common/cpu_optimizer_streams.h"

// Every family's library defines these same names. Hidden, they are bound inside their own
// library at link time and never resolved against another family's library in the process.
#define DS_CPU_OPTIM_LOCAL __attribute__((visibility("hidden")))

namespace deepspeed_cpp {
namespace cpu_optim {

using FamilyRangeKernels = RangeKernels<FamilyCoefficients>;

DS_CPU_OPTIM_LOCAL FamilyRangeKernels family_kernels_scalar(const StreamTypes& types);
#if defined(__x86_64__)
DS_CPU_OPTIM_LOCAL FamilyRangeKernels family_kernels_avx2(const StreamTypes& types);
DS_CPU_OPTIM_LOCAL FamilyRangeKernels family_kernels_avx512(const StreamTypes& types);
#endif
#if defined(__aarch64__)
DS_CPU_OPTIM_LOCAL FamilyRangeKernels family_kernels_neon(const StreamTypes& types);
#endif

// One step of the family over every tensor at the ISA level selected for this process:
// gradients are multiplied by 1 / grad_scale first; with a found_inf flag (see
// run_multi_tensor_step) non-finite gradients skip the whole step. Throws
// std::invalid_argument, naming `op`, for a combination of storage types the loops lack.
DS_CPU_OPTIM_LOCAL void run_family_step(const char* op, const std::vector<OptimizerTensor>& tensors,
                                        const StreamTypes& types,
                                        const FamilyCoefficients& coefficients, double grad_scale,
                                        float* found_inf);

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
