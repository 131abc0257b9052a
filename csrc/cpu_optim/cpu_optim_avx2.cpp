// The AVX2 + FMA + F16C instantiation of a CPU optimizer family's loops. Everything after the
// pragma is compiled for that level, and is reached only when cpu_isa.h selected it.
#if defined(__x86_64__)
#include <immintrin.h>

#include <cmath>
#include <type_traits>

#include "family_levels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "../common/cpu_simd_avx2.h"
#include "../common/cpu_stream_loop.h"
#include DS_CPU_OPTIM_FAMILY_LANES

namespace deepspeed_cpp {
namespace cpu_optim {

FamilyRangeKernels family_kernels_avx2(const StreamTypes& types) {
  return pick_kernels<Avx2Lanes, FamilyKernel>(types);
}

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
#pragma GCC pop_options
#endif  // __x86_64__
