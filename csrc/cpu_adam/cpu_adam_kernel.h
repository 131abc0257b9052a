// Torch-free CPU Adam kernel: raw pointers, sizes and a hyper-parameter struct.
#pragma once

#include <vector>

#include "../common/adam_math.h"
#include "../common/cpu_optimizer_streams.h"

namespace deepspeed_cpp {

// One Adam step over every tensor in one parallel region. Work is cut into fixed-size chunks
// that do not depend on the thread count, and every element goes through adam_update_element's
// operations, so results are bitwise identical for any number of threads and any ISA level.
// Storage types per `types` (param float32/bfloat16/float16, grad likewise, state float32 or
// bfloat16, optional low-precision copy of a float32 param); tensor.state[0] is exp_avg,
// state[1] exp_avg_sq. Gradients are multiplied by 1 / grad_scale first. With a found_inf flag
// (see run_multi_tensor_step) non-finite gradients skip the whole step.
// Throws std::invalid_argument for a combination of types the kernel does not have.
void cpu_adam_update(const std::vector<cpu_optim::OptimizerTensor>& tensors,
                     const cpu_optim::StreamTypes& types, const AdamHyperParams& hp,
                     double grad_scale, float* found_inf);

}  // namespace deepspeed_cpp
