// Host entry points of the MoE gating CUDA kernels. Torch-free and CUDA-header-free, so that the
// ATen glue (C++ compiler) and the kernels (nvcc) share only these declarations.
#pragma once

#include <string>

#include "gating_kernel.h"

namespace deepspeed_cpp {
namespace moe {

// Pointers are device pointers of the layouts in gating_kernel.h; `is_double` says whether the
// floating tensors (logits, noise, prob, weight) are float64 rather than float32. `prob` is a
// [tokens, k] scratch buffer. Returns an empty string on success, else the first CUDA error.
std::string launch_moe_gating_cuda(const void* logits, const void* noise, const double* priority,
                                   bool is_double, const GatingShape& shape, int64_t* expert,
                                   void* prob, int64_t* position, bool* kept, int64_t* slot_counts,
                                   void* weight, void* stream);

std::string launch_moe_gating_backward_cuda(const void* grad_weight, const void* logits,
                                            const int64_t* expert, const bool* kept, bool is_double,
                                            const GatingShape& shape, void* grad_logits,
                                            void* stream);

}  // namespace moe
}  // namespace deepspeed_cpp
