// Argument checks for ops built against PyTorch's stable C ABI (csrc/cpu_optim's glue, the CPU
// optimizer ops). TORCH_CHECK and c10::str live in libc10's C++ ABI, which changes with every
// torch release; these raise std::runtime_error from header-only code instead, which torch turns
// into a Python RuntimeError carrying the message, as it does for TORCH_CHECK.
#pragma once

#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>

namespace deepspeed_cpp {
namespace stable_glue {

template <class... Parts>
[[noreturn]] void raise_error(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

// Prints a shape or strides as c10 does: [2, 3], [] for none.
struct Dims {
  torch::headeronly::IntHeaderOnlyArrayRef values;
};

inline std::ostream& operator<<(std::ostream& out, const Dims& dims) {
  out << "[";
  for (size_t i = 0; i < dims.values.size(); ++i) out << (i ? ", " : "") << dims.values[i];
  return out << "]";
}

// Prints a tensor's device as c10 does (cpu, cuda:0, meta), from the shim's device codes, which
// every stable ABI version has; a device type with no name here is printed by its code.
struct DeviceName {
  AtenTensorHandle tensor;  // borrowed: the C handle, as torch::stable types are hidden symbols
};

inline std::ostream& operator<<(std::ostream& out, const DeviceName& device) {
  int32_t type = 0;
  int32_t index = -1;
  aoti_torch_get_device_type(device.tensor, &type);
  aoti_torch_get_device_index(device.tensor, &index);
  if (type == aoti_torch_device_type_cpu()) {
    out << "cpu";
  } else if (type == aoti_torch_device_type_cuda()) {
    out << "cuda";
  } else if (type == aoti_torch_device_type_meta()) {
    out << "meta";
  } else {
    out << "device type " << type;
  }
  if (index >= 0 && type != aoti_torch_device_type_cpu()) out << ":" << index;
  return out;
}

}  // namespace stable_glue
}  // namespace deepspeed_cpp

// Raises RuntimeError(parts...) unless `cond` holds; the message is built only on failure.
#define DS_CHECK(cond, ...)                                              \
  do {                                                                   \
    if (!(cond)) ::deepspeed_cpp::stable_glue::raise_error(__VA_ARGS__); \
  } while (0)
