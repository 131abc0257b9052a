#include "fused_adam_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace deepspeed_cpp {
namespace {

std::string indexed(const char* list, size_t index) {
  return std::string(list) + "[" + std::to_string(index) + "]";
}

// One argument's bytes, for the aliasing check.
struct MemoryRange {
  uintptr_t begin;
  uintptr_t end;
  bool written;  // params, exp_avgs and exp_avg_sqs are updated in place; grads only read
  const char* list;
  size_t index;
};

// A tensor the op writes must share no byte with any other argument: the kernel's blocks would
// race on it, and the result would depend on the order they run in. Grads may share memory with
// each other (they are only read). Sorted by start, a range overlaps an earlier one exactly when
// it starts before the furthest end seen so far, so tracking the range with the furthest end
// (among all, and among the written ones) finds a clash if there is one.
void check_no_aliasing(std::vector<MemoryRange> ranges) {
  std::sort(ranges.begin(), ranges.end(),
            [](const MemoryRange& a, const MemoryRange& b) { return a.begin < b.begin; });
  const MemoryRange* furthest = nullptr;
  const MemoryRange* furthest_written = nullptr;
  for (const MemoryRange& range : ranges) {
    const MemoryRange* clash = nullptr;
    if (range.written && furthest != nullptr && furthest->end > range.begin) {
      clash = furthest;
    } else if (furthest_written != nullptr && furthest_written->end > range.begin) {
      clash = furthest_written;
    }
    TORCH_CHECK(clash == nullptr, "fused_adam: ", indexed(clash->list, clash->index), " and ",
                indexed(range.list, range.index),
                " share memory (overlap); params, exp_avgs and exp_avg_sqs are updated in place "
                "and must not overlap any other argument");
    if (furthest == nullptr || range.end > furthest->end) furthest = &range;
    if (range.written && (furthest_written == nullptr || range.end > furthest_written->end)) {
      furthest_written = &range;
    }
  }
}

const char* device_type_name(c10::DeviceType type) {
  return type == c10::DeviceType::CUDA ? "CUDA" : type == c10::DeviceType::CPU ? "CPU" : "other";
}

ElementType element_type_of(const at::Tensor& t, const std::string& name) {
  const at::ScalarType type = t.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kHalf,
              "fused_adam: ", name, " must be float32, bfloat16 or float16, got dtype ", type);
  return type == at::kFloat      ? ElementType::kFloat32
         : type == at::kBFloat16 ? ElementType::kBFloat16
                                 : ElementType::kFloat16;
}

// Device, layout and contiguity; `device` is the call's device once one tensor has set it.
void check_placement(const at::Tensor& t, const std::string& name, c10::DeviceType device_type,
                     std::optional<c10::Device>& device) {
  TORCH_CHECK(t.device().type() == device_type, "fused_adam: ", name, " must be a ",
              device_type_name(device_type), " tensor, got device ", t.device());
  if (device.has_value()) {
    TORCH_CHECK(t.device() == *device, "fused_adam: ", name, " is on ", t.device(),
                " but the other tensors are on ", *device, "; one call updates one device");
  } else {
    device = t.device();
  }
  TORCH_CHECK(t.layout() == at::kStrided, "fused_adam: ", name,
              " must be a dense tensor, got layout ", t.layout());
  TORCH_CHECK(t.is_contiguous(), "fused_adam: ", name, " must be contiguous, got strides ",
              t.strides(), " for shape ", t.sizes());
}

// A one-element float32 tensor read by the kernel (lr, a step, the inverse scale, found_inf).
const float* checked_scalar(const at::Tensor& t, const std::string& name,
                            c10::DeviceType device_type, std::optional<c10::Device>& device) {
  check_placement(t, name, device_type, device);
  TORCH_CHECK(t.numel() == 1, "fused_adam: ", name, " must have exactly one element, got ",
              t.numel(), " (shape ", t.sizes(), ")");
  TORCH_CHECK(t.scalar_type() == at::kFloat, "fused_adam: ", name, " must be float32, got dtype ",
              t.scalar_type());
  return t.data_ptr<float>();
}

}  // namespace

FusedAdamCall checked_fused_adam_call(at::TensorList params, at::TensorList grads,
                                      at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                      int64_t step, double lr, double beta1, double beta2,
                                      double eps, double weight_decay, bool bias_correction,
                                      bool adamw_mode, const std::optional<at::Tensor>& lr_tensor,
                                      std::optional<at::TensorList> state_steps,
                                      const std::optional<at::Tensor>& inv_grad_scale,
                                      const std::optional<at::Tensor>& found_inf,
                                      c10::DeviceType device_type) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n,
              "fused_adam: the four lists must have equal lengths, got params=", n,
              ", grads=", grads.size(), ", exp_avgs=", exp_avgs.size(),
              ", exp_avg_sqs=", exp_avg_sqs.size());
  TORCH_CHECK(!state_steps.has_value() || state_steps->size() == n,
              "fused_adam: state_steps must have one tensor per parameter, got ",
              state_steps.has_value() ? state_steps->size() : 0, " for ", n, " parameters");
  TORCH_CHECK(state_steps.has_value() || step >= 1,
              "fused_adam: step must be >= 1 (the step number after this update), got ", step);
  TORCH_CHECK(lr >= 0.0, "fused_adam: lr must be >= 0, got ", lr);
  // Infinite values pass the range checks but turn every parameter into inf or NaN.
  TORCH_CHECK(std::isfinite(lr), "fused_adam: lr must be finite, got ", lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "fused_adam: beta1 must be in [0, 1), got ", beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "fused_adam: beta2 must be in [0, 1), got ", beta2);
  TORCH_CHECK(eps >= 0.0, "fused_adam: eps must be >= 0, got ", eps);
  TORCH_CHECK(std::isfinite(eps), "fused_adam: eps must be finite, got ", eps);
  TORCH_CHECK(weight_decay >= 0.0, "fused_adam: weight_decay must be >= 0, got ", weight_decay);
  TORCH_CHECK(std::isfinite(weight_decay), "fused_adam: weight_decay must be finite, got ",
              weight_decay);

  FusedAdamCall call{};
  call.hyper =
      AdamHyperParams{lr, beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode};
  std::optional<c10::Device> device;
  if (lr_tensor.has_value()) {
    call.lr = checked_scalar(*lr_tensor, "lr_tensor", device_type, device);
  }
  if (inv_grad_scale.has_value()) {
    call.inv_grad_scale = checked_scalar(*inv_grad_scale, "inv_grad_scale", device_type, device);
  }
  if (found_inf.has_value()) {
    call.found_inf = checked_scalar(*found_inf, "found_inf", device_type, device);
  }
  if (n == 0) {
    return call;
  }
  call.param_type = element_type_of(params[0], "params[0]");
  call.grad_type = element_type_of(grads[0], "grads[0]");
  call.state_type = element_type_of(exp_avgs[0], "exp_avgs[0]");
  TORCH_CHECK(call.state_type == ElementType::kFloat32 || call.state_type == call.param_type,
              "fused_adam: exp_avgs[0] must be float32 or the parameters' dtype ",
              params[0].scalar_type(), ", got dtype ", exp_avgs[0].scalar_type());
  call.tensors.reserve(n);
  std::vector<MemoryRange> ranges;
  ranges.reserve(4 * n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = params[i].numel();
    // Each tensor with the dtype it must share: its list's first, and for exp_avg_sqs the
    // state dtype set by exp_avgs[0] (the kernel is instantiated for one state type).
    const struct {
      const at::Tensor& tensor;
      const char* list;
      const at::Tensor& dtype_source;
      const char* dtype_source_name;
    } members[] = {{params[i], "params", params[0], "params[0]"},
                   {grads[i], "grads", grads[0], "grads[0]"},
                   {exp_avgs[i], "exp_avgs", exp_avgs[0], "exp_avgs[0]"},
                   {exp_avg_sqs[i], "exp_avg_sqs", exp_avgs[0], "exp_avgs[0]"}};
    for (const auto& member : members) {
      const std::string name = indexed(member.list, i);
      check_placement(member.tensor, name, device_type, device);
      TORCH_CHECK(member.tensor.scalar_type() == member.dtype_source.scalar_type(),
                  "fused_adam: ", name, " has dtype ", member.tensor.scalar_type(), " but ",
                  member.dtype_source_name, " has ", member.dtype_source.scalar_type(),
                  "; one call takes one dtype per list");
      TORCH_CHECK(member.tensor.numel() == numel, "fused_adam: ", name, " has ",
                  member.tensor.numel(), " elements (shape ", member.tensor.sizes(), ") but ",
                  indexed("params", i), " has ", numel);
      if (numel > 0) {
        const auto begin = reinterpret_cast<uintptr_t>(member.tensor.data_ptr());
        ranges.push_back(MemoryRange{begin, begin + member.tensor.nbytes(),
                                     member.list != std::string("grads"), member.list, i});
      }
    }
    FusedAdamTensor tensor{};
    tensor.param = params[i].data_ptr();
    tensor.grad = grads[i].data_ptr();
    tensor.exp_avg = exp_avgs[i].data_ptr();
    tensor.exp_avg_sq = exp_avg_sqs[i].data_ptr();
    tensor.numel = numel;
    if (state_steps.has_value()) {
      tensor.step =
          checked_scalar((*state_steps)[i], indexed("state_steps", i), device_type, device);
    }
    call.tensors.push_back(tensor);
  }
  check_no_aliasing(std::move(ranges));
  return call;
}

std::vector<FusedAdamLaunchArgs> checked_fused_adam_launches(const FusedAdamCall& call,
                                                             const MultiTensorCapacity& capacity) {
  try {
    return encode_fused_adam_launches(call, capacity);
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK(false, error.what());
  }
}

}  // namespace deepspeed_cpp
