// Stable-ABI glue for the CPU Adagrad kernel: argument checks and the CPU registration.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>
#include <stdexcept>
#include <vector>

#include "../cpu_optim/cpu_optimizer_glue.h"
#include "cpu_adagrad_kernel.h"

namespace deepspeed_cpp {
namespace {

using torch::stable::Tensor;
// A Tensor[] argument: the stable ABI hands each call its own vector of tensor handles.
using TensorList = std::vector<Tensor>;

constexpr const char* kOp = "cpu_adagrad";

void cpu_adagrad_step_multi_cpu(const TensorList& params, const TensorList& grads,
                                const TensorList& state_sums, int64_t step, double lr, double eps,
                                double weight_decay, double lr_decay,
                                const std::optional<TensorList>& params_lowp, double grad_scale,
                                const std::optional<Tensor>& found_inf) {
  const size_t n = params.size();
  cpu_optim::check_list_length(kOp, "grads", grads.size(), n);
  cpu_optim::check_list_length(kOp, "state_sums", state_sums.size(), n);
  if (params_lowp.has_value()) {
    cpu_optim::check_list_length(kOp, "params_lowp", params_lowp->size(), n);
  }
  DS_CHECK(step >= 1, "cpu_adagrad: step must be >= 1 (the step number after this update), got ",
           step);
  DS_CHECK(lr >= 0.0, "cpu_adagrad: lr must be >= 0, got ", lr);
  DS_CHECK(eps >= 0.0, "cpu_adagrad: eps must be >= 0, got ", eps);
  DS_CHECK(weight_decay >= 0.0, "cpu_adagrad: weight_decay must be >= 0, got ", weight_decay);
  DS_CHECK(lr_decay >= 0.0, "cpu_adagrad: lr_decay must be >= 0, got ", lr_decay);
  cpu_optim::StepTensorCollector collected(kOp);
  for (size_t i = 0; i < n; ++i) {
    collected.add(static_cast<int64_t>(i), params[i], grads[i], {{"state_sum", &state_sums[i]}},
                  params_lowp.has_value() ? &(*params_lowp)[i] : nullptr);
  }
  collected.check_no_shared_memory();
  const double scale = cpu_optim::checked_grad_scale(kOp, grad_scale);
  float* flag = cpu_optim::checked_found_inf(kOp, found_inf);
  try {
    cpu_adagrad_update(collected.tensors(), collected.types(),
                       AdagradHyperParams{lr, eps, weight_decay, lr_decay, step}, scale, flag);
  } catch (const std::invalid_argument& error) {
    stable_glue::raise_error(error.what());
  }
}

}  // namespace
}  // namespace deepspeed_cpp

STABLE_TORCH_LIBRARY_IMPL(deepspeed_cpp, CPU, m) {
  m.impl("cpu_adagrad_step_multi", TORCH_BOX(&deepspeed_cpp::cpu_adagrad_step_multi_cpu));
}
