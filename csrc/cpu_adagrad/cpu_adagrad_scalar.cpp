// The portable (no vector extension) instantiation of the CPU Adagrad loops.
#include <cmath>
#include <type_traits>

#include "cpu_adagrad_levels.h"
//
#include "../common/cpu_stream_loop.h"
#include "adagrad_lanes.h"

namespace deepspeed_cpp {

AdagradRangeKernels adagrad_kernels_scalar(const cpu_optim::StreamTypes& types) {
  return cpu_optim::pick_kernels<cpu_optim::ScalarLanes, cpu_optim::AdagradKernel>(types);
}

}  // namespace deepspeed_cpp
