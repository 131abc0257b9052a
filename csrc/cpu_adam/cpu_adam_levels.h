// The Adam loops of each ISA level, one translation unit per level (cpu_adam_<level>.cpp).
// Only the level selected at run time (common/cpu_isa.h) may be called: the others may contain
// instructions this CPU lacks.
#pragma once

#include "../common/adam_math.h"
#include "../common/cpu_optimizer_streams.h"

namespace deepspeed_cpp {

using AdamRangeKernels = cpu_optim::RangeKernels<AdamCoefficients>;

AdamRangeKernels adam_kernels_scalar(const cpu_optim::StreamTypes& types);
#if defined(__x86_64__)
AdamRangeKernels adam_kernels_avx2(const cpu_optim::StreamTypes& types);
AdamRangeKernels adam_kernels_avx512(const cpu_optim::StreamTypes& types);
#endif
#if defined(__aarch64__)
AdamRangeKernels adam_kernels_neon(const cpu_optim::StreamTypes& types);
#endif

}  // namespace deepspeed_cpp
