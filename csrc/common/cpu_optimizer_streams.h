// What a CPU optimizer kernel reads and writes for one tensor, and the function types through
// which a family reaches its per-ISA, per-dtype loops. Torch-free.
#pragma once

#include <cstdint>

namespace deepspeed_cpp {
namespace cpu_optim {

// Storage type of one stream. kNone marks an absent optional stream (the low-precision copy).
enum class ElementType : uint8_t { kFloat32, kBFloat16, kFloat16, kNone };

// The storage types of one step; every tensor of a call shares them.
struct StreamTypes {
  ElementType param = ElementType::kFloat32;
  ElementType grad = ElementType::kFloat32;
  ElementType state = ElementType::kFloat32;
  ElementType param_lowp = ElementType::kNone;  // only with a float32 param
};

// Up to this many optimizer-state tensors per parameter (Adam: exp_avg and exp_avg_sq).
constexpr int kMaxStates = 2;

// One parameter's streams: param and states are read and written in place, grad is read, and
// param_lowp (when present) receives the updated parameter rounded to its type. All contiguous,
// `numel` elements each, typed as StreamTypes says.
struct OptimizerTensor {
  void* param;
  const void* grad;
  void* state[kMaxStates];
  void* param_lowp;
  int64_t numel;
};

// Updates elements [begin, end) of one tensor. `grad_multiplier` multiplies every gradient first
// (1 / loss scale; multiplying by 1 changes nothing).
template <class Coefficients>
using RangeUpdateFn = void (*)(const OptimizerTensor& tensor, int64_t begin, int64_t end,
                               const Coefficients& coefficients, float grad_multiplier);

// Whether any of grad[begin, end) * grad_multiplier is an infinity or a NaN.
using RangeCheckFn = bool (*)(const void* grad, int64_t begin, int64_t end, float grad_multiplier);

// The loops one ISA level offers for one StreamTypes; null members mean "not supported".
template <class Coefficients>
struct RangeKernels {
  RangeUpdateFn<Coefficients> update = nullptr;
  RangeCheckFn check = nullptr;
};

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
