// Every schema of the deepspeed_cpp operator library, in one place.
//
// Conventions: ops are stateless (hyper-parameters and the step number travel in the call,
// optimizer state lives in tensors the caller owns); every argument an op writes is annotated
// with an alias set (Tensor(a!)); ops that only mutate return ().
//
// This file is built into its own small library, loaded before any op family's library, so that
// families can be built and loaded independently (each adds TORCH_LIBRARY_IMPL blocks only).
// Schemas are plain strings, so the library uses PyTorch's stable C ABI: like the CPU optimizer
// families, one build of it loads under every torch from the targeted version onwards.
#include <torch/csrc/stable/library.h>

STABLE_TORCH_LIBRARY(deepspeed_cpp, m) {
  // csrc/cpu_adam, csrc/cpu_adagrad, csrc/cpu_lion: one optimizer step on CPU tensors, in place.
  // Storage: params float32/bfloat16/float16, grads float32/bfloat16/float16, state float32 or
  // bfloat16 (one dtype per argument, shared by a list). Optional keyword arguments:
  // param_lowp receives the updated float32 param rounded to its dtype (bfloat16/float16) in the
  // same pass; gradients are divided by grad_scale (the loss scale) first; found_inf (one float32
  // element) makes the call a no-op when non-zero on entry, and otherwise is set to 1 (nothing
  // written) or 0 after checking every gradient for infinities and NaNs.
  m.def(
      "cpu_adam_step(Tensor(a!) param, Tensor grad, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, "
      "int step, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool bias_correction, bool adamw_mode, *, Tensor(d!)? param_lowp=None, "
      "float grad_scale=1.0, Tensor(e!)? found_inf=None) -> ()");
  // The same step over lists of tensors, in one parallel region.
  m.def(
      "cpu_adam_step_multi(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool bias_correction, bool adamw_mode, *, "
      "Tensor(d!)[]? params_lowp=None, float grad_scale=1.0, Tensor(e!)? found_inf=None) -> ()");
  // Adagrad as torch.optim.Adagrad: lr / (1 + (step - 1) * lr_decay), L2 weight decay.
  m.def(
      "cpu_adagrad_step_multi(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] state_sums, "
      "int step, float lr, float eps, float weight_decay, float lr_decay, *, "
      "Tensor(d!)[]? params_lowp=None, float grad_scale=1.0, Tensor(e!)? found_inf=None) -> ()");
  // Lion (Chen et al. 2023): sign of the interpolated momentum, decoupled weight decay.
  m.def(
      "cpu_lion_step_multi(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "float lr, float beta1, float beta2, float weight_decay, *, "
      "Tensor(d!)[]? params_lowp=None, float grad_scale=1.0, Tensor(e!)? found_inf=None) -> ()");

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
  // `capacity` elements, each padded to a multiple of world_size * alignment; a parameter whose
  // `alone` flag is non-zero gets a bucket of its own (`alone` empty: none). Returns
  // (slots [num_params, 2] = (bucket, offset), bucket_sizes [num_buckets], bucket_groups
  // [num_buckets]).
  m.def(
      "zero_plan_buckets(int[] numels, int[] groups, int capacity, int world_size, int alignment, "
      "int[] alone=[]) -> (Tensor slots, Tensor bucket_sizes, Tensor bucket_groups)");

  // csrc/moe: Mixture-of-Experts gating dispatch (DeepSpeed's top1gating/top2gating) over logits
  // [tokens, experts] (float32/float64). Per (token, slot): combine weight (first, as the one
  // differentiable output), expert index, position in that expert's capacity buffer (-1 when
  // dropped), kept; and the choices per (slot, expert) before any drop. capacity < 0 keeps every
  // token. noise (same shape as logits) is added to the logits when choosing the last slot
  // (top-1 RSample, top-2 second-expert sampling); priority [tokens] (k = 1 only) lets
  // higher-priority tokens claim capacity first (random token selection). Ties between experts
  // go to the lower index.
  m.def(
      "moe_gating(Tensor logits, int k, int capacity, Tensor? noise=None, "
      "Tensor? priority=None) -> (Tensor weight, Tensor expert, Tensor position, Tensor kept, "
      "Tensor slot_counts)");
  // d(loss)/d(logits) from d(loss)/d(weight) of moe_gating (its autograd formula).
  m.def(
      "moe_gating_backward(Tensor grad_weight, Tensor logits, Tensor expert, Tensor kept) "
      "-> Tensor");
}
