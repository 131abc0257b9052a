// The aarch64 Advanced SIMD instantiation of the CPU Adagrad loops (empty on other architectures).
#if defined(__aarch64__)
#include <cmath>
#include <type_traits>

#include "cpu_adagrad_levels.h"
//
#include "../common/cpu_simd_neon.h"
#include "../common/cpu_stream_loop.h"
#include "adagrad_lanes.h"

namespace deepspeed_cpp {

AdagradRangeKernels adagrad_kernels_neon(const cpu_optim::StreamTypes& types) {
  return cpu_optim::pick_kernels<cpu_optim::NeonLanes, cpu_optim::AdagradKernel>(types);
}

}  // namespace deepspeed_cpp
#endif  // __aarch64__
