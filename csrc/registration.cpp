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

  // csrc/fused_adam: Adam/AdamW over lists of CUDA tensors in a few multi-tensor launches.
  // Params fp32/bf16/fp16 (one dtype per list), state fp32 or the params' dtype. Optional
  // one-element float32 device tensors, read on the device so that the step can be captured in a
  // CUDA graph: lr_tensor replaces lr, state_steps[i] replaces step for tensor i, gradients are
  // multiplied by inv_grad_scale, and a non-zero found_inf makes the call a no-op.
  m.def(
      "fused_adam(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool bias_correction, bool adamw_mode, *, Tensor? lr_tensor=None, "
      "Tensor[]? state_steps=None, Tensor? inv_grad_scale=None, Tensor? found_inf=None) -> ()");

  // csrc/zero: copy tensors into / out of a flat buffer at the given element offsets.
  m.def("zero_flatten_into(Tensor[] tensors, Tensor(a!) flat, int[] offsets) -> ()");
  m.def("zero_unflatten_from(Tensor flat, Tensor(a!)[] tensors, int[] offsets) -> ()");
  // csrc/zero: pack parameters (numels, group ids, in order) into flat buckets of at most
  // `capacity` elements, each padded to a multiple of world_size * alignment. Returns
  // (slots [num_params, 2] = (bucket, offset), bucket_sizes [num_buckets]).
  m.def(
      "zero_plan_buckets(int[] numels, int[] groups, int capacity, int world_size, int alignment) "
      "-> (Tensor slots, Tensor bucket_sizes)");
}
