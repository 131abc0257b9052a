// The AVX-512 instantiation of the CPU Adagrad loops. Everything after the pragma is compiled for
// that level, and is reached only when cpu_isa.h selected it.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "cpu_adagrad_levels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#include "../common/cpu_simd_avx512.h"
#include "../common/cpu_stream_loop.h"
#include "adagrad_lanes.h"

namespace deepspeed_cpp {

AdagradRangeKernels adagrad_kernels_avx512(const cpu_optim::StreamTypes& types) {
  return cpu_optim::pick_kernels<cpu_optim::Avx512Lanes, cpu_optim::AdagradKernel>(types);
}

}  // namespace deepspeed_cpp
#pragma GCC pop_options
#endif  // __x86_64__
