// Torch side of the CPU optimizer ops (cpu_adam, cpu_adagrad, cpu_lion): checks every tensor a
// user passes, naming the argument, its value and what was expected, and turns the tensors into
// the torch-free kernel's OptimizerTensor list. Header-only, shared by the three op families.
//
// Written against PyTorch's stable C ABI (torch::stable::Tensor, STABLE_TORCH_LIBRARY_IMPL): the
// libraries call only the C shim's functions, so one build loads under every torch from the
// version the builder targets (TORCH_TARGET_VERSION, see op_builder/cpu_optimizer.py) onwards.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "../common/cpu_optimizer_streams.h"
#include "stable_check.h"

namespace deepspeed_cpp {
namespace cpu_optim {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

inline std::string indexed_name(const char* name, int64_t index) {
  return index < 0 ? std::string(name) : std::string(name) + "[" + std::to_string(index) + "]";
}

inline ElementType element_type(ScalarType dtype) {
  switch (dtype) {
    case ScalarType::Float:
      return ElementType::kFloat32;
    case ScalarType::BFloat16:
      return ElementType::kBFloat16;
    case ScalarType::Half:
      return ElementType::kFloat16;
    default:
      return ElementType::kNone;
  }
}

// Collects one call's tensors. `index` is -1 for the single-tensor op (names without [i]).
class StepTensorCollector {
 public:
  explicit StepTensorCollector(const char* op) : op_(op) {}
  StepTensorCollector(const StepTensorCollector&) = delete;  // holds pointers into itself
  StepTensorCollector& operator=(const StepTensorCollector&) = delete;

  // Adds parameter `index` with its gradient, state tensors (name, tensor) and optional copy.
  void add(int64_t index, const Tensor& param, const Tensor& grad,
           const std::vector<std::pair<const char*, const Tensor*>>& states,
           const Tensor* param_lowp) {
    const int64_t numel = param.numel();
    check_tensor(param, "param", index, numel);
    check_tensor(grad, "grad", index, numel);
    check_dtype(param, "param", index, param_dtype_, "float32, bfloat16 or float16",
                {ScalarType::Float, ScalarType::BFloat16, ScalarType::Half});
    check_dtype(grad, "grad", index, grad_dtype_, "float32, bfloat16 or float16",
                {ScalarType::Float, ScalarType::BFloat16, ScalarType::Half});
    OptimizerTensor tensor{param.data_ptr(), grad.data_ptr(), {nullptr, nullptr}, nullptr, numel};
    record_memory(param, "param", index);
    record_memory(grad, "grad", index);
    for (size_t k = 0; k < states.size(); ++k) {
      const auto& [name, state] = states[k];
      check_tensor(*state, name, index, numel);
      check_dtype(*state, name, index, state_dtype_, "float32 or bfloat16",
                  {ScalarType::Float, ScalarType::BFloat16});
      record_memory(*state, name, index);
      tensor.state[k] = state->data_ptr();
    }
    if (param_lowp != nullptr) {
      check_tensor(*param_lowp, "param_lowp", index, numel);
      check_dtype(*param_lowp, "param_lowp", index, lowp_dtype_, "bfloat16 or float16",
                  {ScalarType::BFloat16, ScalarType::Half});
      DS_CHECK(param.scalar_type() == ScalarType::Float, op_, ": ",
               indexed_name("param_lowp", index),
               " is only for float32 params (a copy of the float32 master weights), but ",
               indexed_name("param", index), " is ", param.scalar_type(),
               "; a low-precision param is updated in place");
      record_memory(*param_lowp, "param_lowp", index);
      tensor.param_lowp = param_lowp->data_ptr();
    }
    tensors_.push_back(tensor);
  }

  // Every tensor the kernel reads or writes must have memory of its own: the kernel reads each
  // element's gradient and state and writes them back in one pass, so a param that is also its
  // grad, both states in one tensor, or one param listed twice would give results no
  // reference defines. Call once, after the last add.
  void check_no_shared_memory() {
    std::sort(ranges_.begin(), ranges_.end(),
              [](const MemoryRange& a, const MemoryRange& b) { return a.begin < b.begin; });
    for (size_t i = 1; i < ranges_.size(); ++i) {
      const MemoryRange& before = ranges_[i - 1];
      const MemoryRange& after = ranges_[i];
      DS_CHECK(after.begin >= before.end, op_, ": ", before.label, " and ", after.label,
               " share memory; every param, grad, state and param_lowp tensor must have "
               "storage of its own");
    }
  }

  const std::vector<OptimizerTensor>& tensors() const { return tensors_; }
  const StreamTypes& types() const { return types_; }

 private:
  void check_tensor(const Tensor& t, const char* name, int64_t index, int64_t numel) const {
    const std::string label = indexed_name(name, index);
    DS_CHECK(t.is_cpu(), op_, ": ", label, " must be a CPU tensor, got device ",
             stable_glue::DeviceName{t.get()});
    DS_CHECK(t.is_contiguous(), op_, ": ", label, " must be contiguous, got strides ",
             stable_glue::Dims{t.strides()}, " for shape ", stable_glue::Dims{t.sizes()});
    DS_CHECK(t.numel() == numel, op_, ": ", label, " has ", t.numel(), " elements (shape ",
             stable_glue::Dims{t.sizes()}, ") but the param has ", numel);
  }

  // The dtype of one kind of stream, fixed by the first tensor of that kind.
  struct RecordedDtype {
    ElementType* type;
    std::string first_label;
    ScalarType first_dtype = ScalarType::Float;
  };

  // Checks that `t` has one of `allowed` dtypes and the dtype of the first tensor of its kind
  // (every tensor of a list, and both Adam states, share one storage type).
  void check_dtype(const Tensor& t, const char* name, int64_t index, RecordedDtype& recorded,
                   const char* expected, std::initializer_list<ScalarType> allowed) {
    const std::string label = indexed_name(name, index);
    bool ok = false;
    for (ScalarType dtype : allowed) ok = ok || t.scalar_type() == dtype;
    DS_CHECK(ok, op_, ": ", label, " must be ", expected, ", got dtype ", t.scalar_type());
    if (recorded.first_label.empty()) {
      *recorded.type = element_type(t.scalar_type());
      recorded.first_label = label;
      recorded.first_dtype = t.scalar_type();
    } else {
      DS_CHECK(t.scalar_type() == recorded.first_dtype, op_, ": ", label, " has dtype ",
               t.scalar_type(), " but ", recorded.first_label, " has dtype ", recorded.first_dtype,
               "; they must share one dtype");
    }
  }

  struct MemoryRange {
    uintptr_t begin;
    uintptr_t end;
    std::string label;
  };

  // Tensors are contiguous (checked before): their bytes are one range. Empty ones hold none.
  void record_memory(const Tensor& t, const char* name, int64_t index) {
    if (t.numel() == 0) return;
    const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    ranges_.push_back({begin, begin + static_cast<uintptr_t>(t.numel()) * t.element_size(),
                       indexed_name(name, index)});
  }

  const char* op_;
  std::vector<MemoryRange> ranges_;
  StreamTypes types_;
  RecordedDtype param_dtype_{&types_.param, {}};
  RecordedDtype grad_dtype_{&types_.grad, {}};
  RecordedDtype state_dtype_{&types_.state, {}};
  RecordedDtype lowp_dtype_{&types_.param_lowp, {}};
  std::vector<OptimizerTensor> tensors_;
};

inline void check_list_length(const char* op, const char* name, size_t length, size_t expected) {
  DS_CHECK(length == expected, op, ": the lists must have equal lengths, got params=", expected,
           ", ", name, "=", length);
}

inline double checked_grad_scale(const char* op, double grad_scale) {
  DS_CHECK(std::isfinite(grad_scale) && grad_scale > 0.0, op,
           ": grad_scale must be a finite number > 0 (the loss scale), got ", grad_scale);
  // The kernels multiply by 1 / grad_scale in float32: a scale whose reciprocal rounds to 0 or
  // to infinity there would zero every gradient or make each one infinite without a word.
  const float multiplier = static_cast<float>(1.0 / grad_scale);
  DS_CHECK(std::isfinite(multiplier) && multiplier > 0.0f, op, ": grad_scale ", grad_scale,
           " is outside float32's range: its reciprocal ", 1.0 / grad_scale, " rounds to ",
           multiplier, " in float32");
  return grad_scale;
}

inline float* checked_found_inf(const char* op, const std::optional<Tensor>& found_inf) {
  if (!found_inf.has_value()) return nullptr;
  const Tensor& flag = *found_inf;
  DS_CHECK(flag.is_cpu() && flag.scalar_type() == ScalarType::Float && flag.numel() == 1, op,
           ": found_inf must be a one-element float32 CPU tensor, got ", flag.scalar_type(),
           " of shape ", stable_glue::Dims{flag.sizes()}, " on ",
           stable_glue::DeviceName{flag.get()});
  return static_cast<float*>(flag.data_ptr());
}

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
