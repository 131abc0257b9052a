// The Adagrad loops of each ISA level, one translation unit per level (cpu_adagrad_<level>.cpp).
// Only the level selected at run time (common/cpu_isa.h) may be called: the others may contain
// instructions this CPU lacks.
#pragma once

#include "../common/cpu_optimizer_streams.h"
#include "adagrad_math.h"

namespace deepspeed_cpp {

using AdagradRangeKernels = cpu_optim::RangeKernels<AdagradCoefficients>;

AdagradRangeKernels adagrad_kernels_scalar(const cpu_optim::StreamTypes& types);
#if defined(__x86_64__)
AdagradRangeKernels adagrad_kernels_avx2(const cpu_optim::StreamTypes& types);
AdagradRangeKernels adagrad_kernels_avx512(const cpu_optim::StreamTypes& types);
#endif
#if defined(__aarch64__)
AdagradRangeKernels adagrad_kernels_neon(const cpu_optim::StreamTypes& types);
#endif

}  // namespace deepspeed_cpp
