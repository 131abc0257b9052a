// The AVX2 + FMA + F16C instantiation of the CPU Lion loops. Everything after the pragma is
// compiled for that level, and is reached only when cpu_isa.h selected it.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "cpu_lion_levels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "../common/cpu_simd_avx2.h"
#include "../common/cpu_stream_loop.h"
#include "lion_lanes.h"

namespace deepspeed_cpp {

LionRangeKernels lion_kernels_avx2(const cpu_optim::StreamTypes& types) {
  return cpu_optim::pick_kernels<cpu_optim::Avx2Lanes, cpu_optim::LionKernel>(types);
}

}  // namespace deepspeed_cpp
#pragma GCC pop_options
#endif  // __x86_64__
