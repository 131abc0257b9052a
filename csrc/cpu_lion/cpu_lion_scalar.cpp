// The portable (no vector extension) instantiation of the CPU Lion loops.
#include <cmath>
#include <type_traits>

#include "cpu_lion_levels.h"
//
#include "../common/cpu_stream_loop.h"
#include "lion_lanes.h"

namespace deepspeed_cpp {

LionRangeKernels lion_kernels_scalar(const cpu_optim::StreamTypes& types) {
  return cpu_optim::pick_kernels<cpu_optim::ScalarLanes, cpu_optim::LionKernel>(types);
}

}  // namespace deepspeed_cpp
