#include "cpu_lion_kernel.h"

#include <stdexcept>

#include "../common/cpu_isa.h"
#include "../common/cpu_multi_tensor.h"
#include "cpu_lion_levels.h"

namespace deepspeed_cpp {
namespace {

LionRangeKernels kernels_for(CpuIsa isa, const cpu_optim::StreamTypes& types) {
  switch (isa) {
#if defined(__x86_64__)
    case CpuIsa::kAvx512:
      return lion_kernels_avx512(types);
    case CpuIsa::kAvx2:
      return lion_kernels_avx2(types);
#endif
#if defined(__aarch64__)
    case CpuIsa::kNeon:
      return lion_kernels_neon(types);
#endif
    default:
      return lion_kernels_scalar(types);
  }
}

}  // namespace

void cpu_lion_update(const std::vector<cpu_optim::OptimizerTensor>& tensors,
                     const cpu_optim::StreamTypes& types, const LionHyperParams& hp,
                     double grad_scale, float* found_inf) {
  const LionRangeKernels kernels = kernels_for(selected_cpu_isa(), types);
  if (kernels.update == nullptr || kernels.check == nullptr) {
    throw std::invalid_argument(
        "cpu_lion: this combination of parameter, gradient, state and copy types is not "
        "implemented");
  }
  cpu_optim::run_multi_tensor_step(tensors, kernels, make_lion_coefficients(hp),
                                   static_cast<float>(1.0 / grad_scale), found_inf);
}

const char* cpu_lion_isa_name() { return cpu_isa_name(selected_cpu_isa()); }

}  // namespace deepspeed_cpp
