#include "cpu_adam_kernel.h"

#include "../cpu_optim/family_levels.h"

namespace deepspeed_cpp {

void cpu_adam_update(const std::vector<cpu_optim::OptimizerTensor>& tensors,
                     const cpu_optim::StreamTypes& types, const AdamHyperParams& hp,
                     double grad_scale, float* found_inf) {
  cpu_optim::run_family_step("cpu_adam", tensors, types, make_adam_coefficients(hp), grad_scale,
                             found_inf);
}

}  // namespace deepspeed_cpp
