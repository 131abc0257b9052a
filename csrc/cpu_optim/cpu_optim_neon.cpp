// The aarch64 Advanced SIMD instantiation of a CPU optimizer family's loops (empty on other
// architectures).
#if defined(__aarch64__)
#include <cmath>
#include <type_traits>

#include "family_levels.h"
//
#include "../common/cpu_simd_neon.h"
#include "../common/cpu_stream_loop.h"
#include DS_CPU_OPTIM_FAMILY_LANES

namespace deepspeed_cpp {
namespace cpu_optim {

FamilyRangeKernels family_kernels_neon(const StreamTypes& types) {
  return pick_kernels<NeonLanes, FamilyKernel>(types);
}

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
#endif  // __aarch64__
