// ATen glue for the CPU Adam kernel: argument checks and the CPU registrations.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "cpu_adam_kernel.h"

namespace deepspeed_cpp {
namespace {

void check_state_tensor(const at::Tensor& t, const char* what, int64_t index, int64_t numel) {
  const std::string name =
      index < 0 ? std::string(what) : std::string(what) + "[" + std::to_string(index) + "]";
  TORCH_CHECK(t.device().is_cpu(), "cpu_adam: ", name, " must be a CPU tensor, got device ",
              t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat, "cpu_adam: ", name, " must be float32, got dtype ",
              t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "cpu_adam: ", name, " must be contiguous, got strides ",
              t.strides(), " for shape ", t.sizes());
  TORCH_CHECK(t.numel() == numel, "cpu_adam: ", name, " has ", t.numel(), " elements (shape ",
              t.sizes(), ") but the parameter has ", numel);
}

AdamHyperParams checked_hyper_params(int64_t step, double lr, double beta1, double beta2,
                                     double eps, double weight_decay, bool bias_correction,
                                     bool adamw_mode) {
  TORCH_CHECK(step >= 1, "cpu_adam: step must be >= 1 (the step number after this update), got ",
              step);
  TORCH_CHECK(lr >= 0.0, "cpu_adam: lr must be >= 0, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "cpu_adam: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "cpu_adam: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "cpu_adam: eps must be >= 0, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "cpu_adam: weight_decay must be >= 0, got ", weight_decay);
  return AdamHyperParams{lr, beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode};
}

AdamTensorView checked_view(const at::Tensor& param, const at::Tensor& grad,
                            const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                            int64_t index) {
  const int64_t numel = param.numel();
  check_state_tensor(param, "param", index, numel);
  check_state_tensor(grad, "grad", index, numel);
  check_state_tensor(exp_avg, "exp_avg", index, numel);
  check_state_tensor(exp_avg_sq, "exp_avg_sq", index, numel);
  return AdamTensorView{param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                        exp_avg_sq.data_ptr<float>(), numel};
}

void cpu_adam_step_cpu(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg,
                       at::Tensor& exp_avg_sq, int64_t step, double lr, double beta1, double beta2,
                       double eps, double weight_decay, bool bias_correction, bool adamw_mode) {
  const AdamHyperParams hp =
      checked_hyper_params(step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode);
  cpu_adam_update({checked_view(param, grad, exp_avg, exp_avg_sq, -1)}, hp);
}

void cpu_adam_step_multi_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                             at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1,
                             double beta2, double eps, double weight_decay, bool bias_correction,
                             bool adamw_mode) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "cpu_adam_multi: the four lists must have equal lengths, got params=", n,
              ", grads=", grads.size(), ", exp_avgs=", exp_avgs.size(),
              ", exp_avg_sqs=", exp_avg_sqs.size());
  const AdamHyperParams hp =
      checked_hyper_params(step, lr, beta1, beta2, eps, weight_decay, bias_correction, adamw_mode);
  std::vector<AdamTensorView> views;
  views.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    views.push_back(
        checked_view(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], static_cast<int64_t>(i)));
  }
  cpu_adam_update(views, hp);
}

}  // namespace
}  // namespace deepspeed_cpp

TORCH_LIBRARY_IMPL(deepspeed_cpp, CPU, m) {
  m.impl("cpu_adam_step", &deepspeed_cpp::cpu_adam_step_cpu);
  m.impl("cpu_adam_step_multi", &deepspeed_cpp::cpu_adam_step_multi_cpu);
}

// Read by the report command through ctypes; not an operator because it describes the build.
extern "C" const char* deepspeed_cpp_cpu_adam_isa() { return deepspeed_cpp::cpu_adam_isa_name(); }
