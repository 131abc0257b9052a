#include "cpu_adam_kernel.h"

#include <stdexcept>
#include <string>

#include "../common/cpu_isa.h"
#include "../common/cpu_multi_tensor.h"
#include "cpu_adam_levels.h"

namespace deepspeed_cpp {
namespace {

AdamRangeKernels kernels_for(CpuIsa isa, const cpu_optim::StreamTypes& types) {
  switch (isa) {
#if defined(__x86_64__)
    case CpuIsa::kAvx512:
      return adam_kernels_avx512(types);
    case CpuIsa::kAvx2:
      return adam_kernels_avx2(types);
#endif
#if defined(__aarch64__)
    case CpuIsa::kNeon:
      return adam_kernels_neon(types);
#endif
    default:
      return adam_kernels_scalar(types);
  }
}

}  // namespace

void cpu_adam_update(const std::vector<cpu_optim::OptimizerTensor>& tensors,
                     const cpu_optim::StreamTypes& types, const AdamHyperParams& hp,
                     double grad_scale, float* found_inf) {
  const AdamRangeKernels kernels = kernels_for(selected_cpu_isa(), types);
  if (kernels.update == nullptr || kernels.check == nullptr) {
    throw std::invalid_argument(
        "cpu_adam: this combination of parameter, gradient, state and copy types is not "
        "implemented");
  }
  cpu_optim::run_multi_tensor_step(tensors, kernels, make_adam_coefficients(hp),
                                   static_cast<float>(1.0 / grad_scale), found_inf);
}

void cpu_adam_update(const std::vector<AdamTensorView>& tensors, const AdamHyperParams& hp) {
  std::vector<cpu_optim::OptimizerTensor> general;
  general.reserve(tensors.size());
  for (const AdamTensorView& t : tensors) {
    general.push_back({t.param, t.grad, {t.exp_avg, t.exp_avg_sq}, nullptr, t.numel});
  }
  cpu_adam_update(general, cpu_optim::StreamTypes{}, hp, 1.0, nullptr);
}

const char* cpu_adam_isa_name() { return cpu_isa_name(selected_cpu_isa()); }

}  // namespace deepspeed_cpp
