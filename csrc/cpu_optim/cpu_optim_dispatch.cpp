// Picks the loops of the ISA level selected at run time and runs one multi-tensor step.
#include <stdexcept>
#include <string>

#include "../common/cpu_isa.h"
#include "../common/cpu_multi_tensor.h"
#include "family_levels.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

FamilyRangeKernels kernels_for(CpuIsa isa, const StreamTypes& types) {
  switch (isa) {
#if defined(__x86_64__)
    case CpuIsa::kAvx512:
      return family_kernels_avx512(types);
    case CpuIsa::kAvx2:
      return family_kernels_avx2(types);
#endif
#if defined(__aarch64__)
    case CpuIsa::kNeon:
      return family_kernels_neon(types);
#endif
    default:
      return family_kernels_scalar(types);
  }
}

}  // namespace

void run_family_step(const char* op, const std::vector<OptimizerTensor>& tensors,
                     const StreamTypes& types, const FamilyCoefficients& coefficients,
                     double grad_scale, float* found_inf) {
  const FamilyRangeKernels kernels = kernels_for(selected_cpu_isa(), types);
  if (kernels.update == nullptr || kernels.check == nullptr) {
    throw std::invalid_argument(
        std::string(op) +
        ": this combination of parameter, gradient, state and copy types is not implemented");
  }
  run_multi_tensor_step(tensors, kernels, coefficients, static_cast<float>(1.0 / grad_scale),
                        found_inf);
}

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
