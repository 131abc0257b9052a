// ATen glue shared by the CUDA op and the host test driver: every check of a fused_adam call,
// and its translation into the torch-free FusedAdamCall.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "fused_adam_launch.h"

namespace deepspeed_cpp {

// Checks the arguments of deepspeed_cpp::fused_adam (see its schema in registration.cpp) with
// TORCH_CHECKs naming the offending argument, its value and what was expected, and describes the
// call. Every tensor must be on one device of type `device_type`.
FusedAdamCall checked_fused_adam_call(at::TensorList params, at::TensorList grads,
                                      at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                      int64_t step, double lr, double beta1, double beta2,
                                      double eps, double weight_decay, bool bias_correction,
                                      bool adamw_mode, const std::optional<at::Tensor>& lr_tensor,
                                      std::optional<at::TensorList> state_steps,
                                      const std::optional<at::Tensor>& inv_grad_scale,
                                      const std::optional<at::Tensor>& found_inf,
                                      c10::DeviceType device_type);

// encode_fused_adam_launches, its std::invalid_argument (a capacity out of range, a tensor with
// more chunks than can be numbered) turned into a torch error.
std::vector<FusedAdamLaunchArgs> checked_fused_adam_launches(const FusedAdamCall& call,
                                                             const MultiTensorCapacity& capacity);

}  // namespace deepspeed_cpp
