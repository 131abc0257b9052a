#include "cpu_adagrad_kernel.h"

#include "../cpu_optim/family_levels.h"

namespace deepspeed_cpp {

void cpu_adagrad_update(const std::vector<cpu_optim::OptimizerTensor>& tensors,
                        const cpu_optim::StreamTypes& types, const AdagradHyperParams& hp,
                        double grad_scale, float* found_inf) {
  cpu_optim::run_family_step("cpu_adagrad", tensors, types, make_adagrad_coefficients(hp),
                             grad_scale, found_inf);
}

}  // namespace deepspeed_cpp
