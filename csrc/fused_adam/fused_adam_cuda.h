// Host entry point of the CUDA kernel. Torch-free and CUDA-header-free, so that the ATen glue
// (compiled by the C++ compiler) and the kernel (compiled by nvcc) share only this declaration.
#pragma once

#include <string>
#include <vector>

#include "fused_adam_launch.h"

namespace deepspeed_cpp {

// Launches one kernel per argument block on `stream` (a cudaStream_t), on the current device.
// Returns an empty string on success, else the CUDA error of the first launch that failed.
std::string launch_fused_adam_cuda(const std::vector<FusedAdamLaunchArgs>& launches,
                                   ElementType param_type, ElementType grad_type,
                                   ElementType state_type, void* stream);

}  // namespace deepspeed_cpp
