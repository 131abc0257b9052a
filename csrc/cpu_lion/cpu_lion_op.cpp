// Stable-ABI glue for the CPU Lion kernel: argument checks and the CPU registration.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>
#include <stdexcept>
#include <vector>

#include "../cpu_optim/cpu_optimizer_glue.h"
#include "cpu_lion_kernel.h"

namespace deepspeed_cpp {
namespace {

using torch::stable::Tensor;
// A Tensor[] argument: the stable ABI hands each call its own vector of tensor handles.
using TensorList = std::vector<Tensor>;

constexpr const char* kOp = "cpu_lion";

void cpu_lion_step_multi_cpu(const TensorList& params, const TensorList& grads,
                             const TensorList& exp_avgs, double lr, double beta1, double beta2,
                             double weight_decay, const std::optional<TensorList>& params_lowp,
                             double grad_scale, const std::optional<Tensor>& found_inf) {
  const size_t n = params.size();
  cpu_optim::check_list_length(kOp, "grads", grads.size(), n);
  cpu_optim::check_list_length(kOp, "exp_avgs", exp_avgs.size(), n);
  if (params_lowp.has_value()) {
    cpu_optim::check_list_length(kOp, "params_lowp", params_lowp->size(), n);
  }
  DS_CHECK(lr >= 0.0, "cpu_lion: lr must be >= 0, got ", lr);
  DS_CHECK(beta1 >= 0.0 && beta1 <= 1.0, "cpu_lion: beta1 must be in [0, 1], got ", beta1);
  DS_CHECK(beta2 >= 0.0 && beta2 <= 1.0, "cpu_lion: beta2 must be in [0, 1], got ", beta2);
  DS_CHECK(weight_decay >= 0.0, "cpu_lion: weight_decay must be >= 0, got ", weight_decay);
  cpu_optim::StepTensorCollector collected(kOp);
  for (size_t i = 0; i < n; ++i) {
    collected.add(static_cast<int64_t>(i), params[i], grads[i], {{"exp_avg", &exp_avgs[i]}},
                  params_lowp.has_value() ? &(*params_lowp)[i] : nullptr);
  }
  collected.check_no_shared_memory();
  const double scale = cpu_optim::checked_grad_scale(kOp, grad_scale);
  float* flag = cpu_optim::checked_found_inf(kOp, found_inf);
  try {
    cpu_lion_update(collected.tensors(), collected.types(),
                    LionHyperParams{lr, beta1, beta2, weight_decay}, scale, flag);
  } catch (const std::invalid_argument& error) {
    stable_glue::raise_error(error.what());
  }
}

}  // namespace
}  // namespace deepspeed_cpp

STABLE_TORCH_LIBRARY_IMPL(deepspeed_cpp, CPU, m) {
  m.impl("cpu_lion_step_multi", TORCH_BOX(&deepspeed_cpp::cpu_lion_step_multi_cpu));
}
