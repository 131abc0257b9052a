// Torch-free CPU Lion kernel: raw pointers, sizes and a hyper-parameter struct.
#pragma once

#include <vector>

#include "../common/cpu_optimizer_streams.h"
#include "lion_math.h"

namespace deepspeed_cpp {

// One Lion step over every tensor in one parallel region; tensor.state[0] is the optimizer's
// one state tensor. Storage types per `types` (see cpu_optimizer_streams.h); gradients are
// multiplied by 1 / grad_scale first; with a found_inf flag (see run_multi_tensor_step)
// non-finite gradients skip the whole step. Bitwise identical for any thread count and ISA level.
// Throws std::invalid_argument for a combination of types the kernel does not have.
void cpu_lion_update(const std::vector<cpu_optim::OptimizerTensor>& tensors,
                     const cpu_optim::StreamTypes& types, const LionHyperParams& hp,
                     double grad_scale, float* found_inf);

}  // namespace deepspeed_cpp
