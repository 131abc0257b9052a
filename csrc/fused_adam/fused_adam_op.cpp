// ATen glue for the fused CUDA Adam: checks, launch planning and the CUDA registration.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

#include "fused_adam_checks.h"
#include "fused_adam_cuda.h"
#include "fused_adam_launch.h"

namespace deepspeed_cpp {
namespace {

void fused_adam_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, bool bias_correction,
                     bool adamw_mode, const std::optional<at::Tensor>& lr_tensor,
                     std::optional<at::TensorList> state_steps,
                     const std::optional<at::Tensor>& inv_grad_scale,
                     const std::optional<at::Tensor>& found_inf) {
  const FusedAdamCall call =
      checked_fused_adam_call(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps,
                              weight_decay, bias_correction, adamw_mode, lr_tensor, state_steps,
                              inv_grad_scale, found_inf, c10::DeviceType::CUDA);
  // Planning is host arithmetic only (no allocation, no synchronisation), so a call can be
  // captured in a CUDA graph: the argument blocks are copied into the graph by value.
  const std::vector<FusedAdamLaunchArgs> launches =
      checked_fused_adam_launches(call, kFusedAdamCapacity);
  if (launches.empty()) {
    return;
  }
  const c10::cuda::CUDAGuard device_guard(params[0].device());
  const std::string error =
      launch_fused_adam_cuda(launches, call.param_type, call.grad_type, call.state_type,
                             c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error.empty(), "fused_adam: kernel launch failed: ", error);
}

}  // namespace
}  // namespace deepspeed_cpp

TORCH_LIBRARY_IMPL(deepspeed_cpp, CUDA, m) {
  m.impl("fused_adam", &deepspeed_cpp::fused_adam_cuda);
}
