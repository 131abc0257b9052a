// Every schema of the deepspeed_cpp operator library, in one place.
//
// Conventions: ops are stateless (hyper-parameters and the step number travel in the call,
// optimizer state lives in tensors the caller owns); every argument an op writes is annotated
// with an alias set (Tensor(a!)); ops that only mutate return ().
//
// This file is built into its own small library, loaded before any op family's library, so that
// families can be built and loaded independently (each adds TORCH_LIBRARY_IMPL blocks only).
#include <torch/library.h>

TORCH_LIBRARY(deepspeed_cpp, m) {
  // csrc/cpu_adam: one Adam/AdamW step over one tensor.
  m.def(
      "cpu_adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "int step, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool bias_correction, bool adamw_mode) -> ()");
  // csrc/cpu_adam: the same step over lists of tensors, in one parallel region.
  m.def(
      "cpu_adam_step_multi(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool bias_correction, bool adamw_mode) -> ()");
}
