// The portable (no vector extension) instantiation of the CPU Adam loops.
#include <cmath>
#include <type_traits>

#include "cpu_adam_levels.h"
//
#include "../common/cpu_stream_loop.h"
#include "adam_lanes.h"

namespace deepspeed_cpp {

AdamRangeKernels adam_kernels_scalar(const cpu_optim::StreamTypes& types) {
  return cpu_optim::pick_kernels<cpu_optim::ScalarLanes, cpu_optim::AdamKernel>(types);
}

}  // namespace deepspeed_cpp
