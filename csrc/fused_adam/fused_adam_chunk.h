// The fused Adam kernel's body: what one thread block does for one (tensor, chunk) of the block
// table. Written as DS_HOST_DEVICE functions of (argument block, block index, thread) so that the
// CUDA kernel is a three-line wrapper and the host test driver runs exactly this code on the CPU.
#pragma once

#include <cmath>
#include <cstdint>

#include "../common/adam_math.h"
#include "../common/host_device.h"
#include "fused_adam_launch.h"
#include "low_precision.h"

namespace deepspeed_cpp {

// The coefficients block `block` uses: folded on the host, unless lr or this tensor's step is
// read from the device. Run once per block (on the GPU by one thread, shared with the others).
DS_HOST_DEVICE inline AdamCoefficients block_coefficients(const FusedAdamLaunchArgs& args,
                                                          int block) {
  const float* step = args.step[args.block_slot[block]];
  if (args.lr == nullptr && step == nullptr) {
    return args.coefficients;
  }
  const double lr = args.lr != nullptr ? double(*args.lr) : args.hyper.lr;
  const int64_t step_number = step != nullptr ? int64_t(*step) : args.hyper.step;
  return adam_coefficients(args.hyper, lr, step_number);
}

// Thread `thread` of `num_threads` updates elements thread, thread + num_threads, ... of the
// block's chunk (consecutive threads touch consecutive elements: coalesced on the GPU). Each
// element is loaded as float, the gradient unscaled by one multiplication (exact for the power-of-
// two scales of loss scaling, and a no-op when there is no scale), updated by the shared
// adam_update_element and stored back rounded to nearest even.
template <typename Param, typename Grad, typename State>
DS_HOST_DEVICE inline void adam_chunk(const FusedAdamLaunchArgs& args, int block,
                                      const AdamCoefficients& c, int thread, int num_threads) {
  if (args.found_inf != nullptr && *args.found_inf != 0.0f) {
    return;
  }
  const int slot = args.block_slot[block];
  const int64_t begin = int64_t(args.block_chunk[block]) * args.chunk_elements;
  const int64_t remaining = args.numel[slot] - begin;
  const int n = int(remaining < args.chunk_elements ? remaining : args.chunk_elements);
  Param* __restrict__ param = static_cast<Param*>(args.param[slot]) + begin;
  const Grad* __restrict__ grad = static_cast<const Grad*>(args.grad[slot]) + begin;
  State* __restrict__ exp_avg = static_cast<State*>(args.exp_avg[slot]) + begin;
  State* __restrict__ exp_avg_sq = static_cast<State*>(args.exp_avg_sq[slot]) + begin;
  const float inv_grad_scale = args.inv_grad_scale != nullptr ? *args.inv_grad_scale : 1.0f;
  for (int i = thread; i < n; i += num_threads) {
    float p = load_as_float(param[i]);
    float m = load_as_float(exp_avg[i]);
    float v = load_as_float(exp_avg_sq[i]);
    const float g = load_as_float(grad[i]) * inv_grad_scale;
    adam_update_element(p, g, m, v, c);
    store_from_float(param[i], p);
    store_from_float(exp_avg[i], m);
    store_from_float(exp_avg_sq[i], v);
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

template <typename F>
void dispatch_element_type(ElementType type, F&& f) {
  switch (type) {
    case ElementType::kFloat32:
      f(TypeTag<float>{});
      return;
    case ElementType::kBFloat16:
      f(TypeTag<BFloat16Bits>{});
      return;
    case ElementType::kFloat16:
      f(TypeTag<Float16Bits>{});
      return;
  }
}

// Calls f(TypeTag<Param>, TypeTag<Grad>, TypeTag<State>) for the call's element types. The state
// is float32 or the parameter's type (the argument checks guarantee it): 15 combinations.
template <typename F>
void dispatch_fused_adam_types(ElementType param, ElementType grad, ElementType state, F&& f) {
  dispatch_element_type(param, [&](auto param_tag) {
    dispatch_element_type(grad, [&](auto grad_tag) {
      if (state == ElementType::kFloat32) {
        f(param_tag, grad_tag, TypeTag<float>{});
      } else {
        f(param_tag, grad_tag, param_tag);
      }
    });
  });
}

}  // namespace deepspeed_cpp
