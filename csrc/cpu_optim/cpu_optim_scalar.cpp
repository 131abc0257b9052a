// The portable (no vector extension) instantiation of a CPU optimizer family's loops.
#include <cmath>
#include <type_traits>

#include "family_levels.h"
//
#include "../common/cpu_stream_loop.h"
#include DS_CPU_OPTIM_FAMILY_LANES

namespace deepspeed_cpp {
namespace cpu_optim {

FamilyRangeKernels family_kernels_scalar(const StreamTypes& types) {
  return pick_kernels<ScalarLanes, FamilyKernel>(types);
}

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
