// Stable-ABI glue for the CPU Adam kernel: argument checks and the CPU registrations.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>

#include <optional>
#include <stdexcept>
#include <vector>

#include "../cpu_optim/cpu_optimizer_glue.h"
#include "cpu_adam_kernel.h"

namespace deepspeed_cpp {
namespace {

using torch::stable::Tensor;
// A Tensor[] argument: the stable ABI hands each call its own vector of tensor handles.
using TensorList = std::vector<Tensor>;

constexpr const char* kOp = "cpu_adam";

AdamHyperParams checked_hyper_params(int64_t step, double lr, double beta1, double beta2,
                                     double eps, double weight_decay, bool bias_correction,
                                     bool adamw_mode) {
  DS_CHECK(step >= 1, "cpu_adam: step must be >= 1 (the step number after this update), got ",
           step);
  DS_CHECK(lr >= 0.0, "cpu_adam: lr must be >= 0, got ", lr);
  DS_CHECK(beta1 >= 0.0 && beta1 < 1.0, "cpu_adam: beta1 must be in [0, 1), got ", beta1);
  DS_CHECK(beta2 >= 0.0 && beta2 < 1.0, "cpu_adam: beta2 must be in [0, 1), got ", beta2);
  DS_CHECK(eps >= 0.0, "cpu_adam: eps must be >= 0, got ", eps);
  DS_CHECK(weight_decay >= 0.0, "cpu_adam: weight_decay must be >= 0, got ", weight_decay);
  return AdamHyperParams{lr, beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode};
}

void run(cpu_optim::StepTensorCollector& collected, const AdamHyperParams& hp, double grad_scale,
         const std::optional<Tensor>& found_inf) {
  collected.check_no_shared_memory();
  const double scale = cpu_optim::checked_grad_scale(kOp, grad_scale);
  float* flag = cpu_optim::checked_found_inf(kOp, found_inf);
  try {
    cpu_adam_update(collected.tensors(), collected.types(), hp, scale, flag);
  } catch (const std::invalid_argument& error) {
    stable_glue::raise_error(error.what());
  }
}

void cpu_adam_step_cpu(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                       int64_t step, double lr, double beta1, double beta2, double eps,
                       double weight_decay, bool bias_correction, bool adamw_mode,
                       const std::optional<Tensor>& param_lowp, double grad_scale,
                       const std::optional<Tensor>& found_inf) {
  const AdamHyperParams hp =
      checked_hyper_params(step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode);
  cpu_optim::StepTensorCollector collected(kOp);
  collected.add(-1, param, grad, {{"exp_avg", &exp_avg}, {"exp_avg_sq", &exp_avg_sq}},
                param_lowp.has_value() ? &*param_lowp : nullptr);
  run(collected, hp, grad_scale, found_inf);
}

void cpu_adam_step_multi_cpu(const TensorList& params, const TensorList& grads,
                             const TensorList& exp_avgs, const TensorList& exp_avg_sqs,
                             int64_t step, double lr, double beta1, double beta2, double eps,
                             double weight_decay, bool bias_correction, bool adamw_mode,
                             const std::optional<TensorList>& params_lowp, double grad_scale,
                             const std::optional<Tensor>& found_inf) {
  const size_t n = params.size();
  cpu_optim::check_list_length("cpu_adam_multi", "grads", grads.size(), n);
  cpu_optim::check_list_length("cpu_adam_multi", "exp_avgs", exp_avgs.size(), n);
  cpu_optim::check_list_length("cpu_adam_multi", "exp_avg_sqs", exp_avg_sqs.size(), n);
  if (params_lowp.has_value()) {
    cpu_optim::check_list_length("cpu_adam_multi", "params_lowp", params_lowp->size(), n);
  }
  const AdamHyperParams hp =
      checked_hyper_params(step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode);
  cpu_optim::StepTensorCollector collected(kOp);
  for (size_t i = 0; i < n; ++i) {
    collected.add(static_cast<int64_t>(i), params[i], grads[i],
                  {{"exp_avg", &exp_avgs[i]}, {"exp_avg_sq", &exp_avg_sqs[i]}},
                  params_lowp.has_value() ? &(*params_lowp)[i] : nullptr);
  }
  run(collected, hp, grad_scale, found_inf);
}

}  // namespace
}  // namespace deepspeed_cpp

STABLE_TORCH_LIBRARY_IMPL(deepspeed_cpp, CPU, m) {
  m.impl("cpu_adam_step", TORCH_BOX(&deepspeed_cpp::cpu_adam_step_cpu));
  m.impl("cpu_adam_step_multi", TORCH_BOX(&deepspeed_cpp::cpu_adam_step_multi_cpu));
}
