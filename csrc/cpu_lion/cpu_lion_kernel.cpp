#include "cpu_lion_kernel.h"

#include "../cpu_optim/family_levels.h"

namespace deepspeed_cpp {

void cpu_lion_update(const std::vector<cpu_optim::OptimizerTensor>& tensors,
                     const cpu_optim::StreamTypes& types, const LionHyperParams& hp,
                     double grad_scale, float* found_inf) {
  cpu_optim::run_family_step("cpu_lion", tensors, types, make_lion_coefficients(hp), grad_scale,
                             found_inf);
}

}  // namespace deepspeed_cpp
