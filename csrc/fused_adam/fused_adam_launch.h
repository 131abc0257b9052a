// The fused Adam kernel's argument block and how a call is cut into launches. Torch-free and
// CUDA-free: the same structs feed the CUDA kernel and the host test driver.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../common/adam_math.h"
#include "multi_tensor_plan.h"

namespace deepspeed_cpp {

// Element types of parameters, gradients and optimizer state.
enum class ElementType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Kernel parameters are limited to 4 KiB on every CUDA version and architecture (CUDA 12.1+ on
// Volta and newer allow 32 KiB; 4 KiB keeps any TORCH_CUDA_ARCH_LIST valid).
inline constexpr size_t kKernelArgumentBytesLimit = 4096;
// One launch's capacity, chosen to fill the 4 KiB: 48 bytes per tensor slot, 5 per block.
inline constexpr int kFusedAdamMaxTensors = 36;
inline constexpr int kFusedAdamMaxBlocks = 440;
// Elements per chunk (= per thread block) and threads per block: 128 elements per thread.
inline constexpr int64_t kFusedAdamChunkElements = 65536;
inline constexpr int kFusedAdamBlockThreads = 512;

inline constexpr MultiTensorCapacity kFusedAdamCapacity{kFusedAdamChunkElements,
                                                        kFusedAdamMaxTensors, kFusedAdamMaxBlocks};

// One tensor's addresses. `step` (nullable) is a one-element float32 device tensor holding the
// step number after this update; when set it replaces the call's host step for this tensor.
struct FusedAdamTensor {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  const float* step;
  int64_t numel;
};

// A whole call, after the argument checks. The three pointers are nullable one-element float32
// device tensors: lr replaces hyper.lr, gradients are multiplied by *inv_grad_scale before the
// update, and a non-zero *found_inf makes the call a no-op. Read on the device, at run time, so
// that a captured CUDA graph sees new values on every replay.
struct FusedAdamCall {
  std::vector<FusedAdamTensor> tensors;
  ElementType param_type;
  ElementType grad_type;
  ElementType state_type;  // float32 or param_type
  AdamHyperParams hyper;
  const float* lr;
  const float* inv_grad_scale;
  const float* found_inf;
};

// Passed by value to each launch. Parallel arrays (not an array of structs) so that the block
// table packs to 5 bytes per block.
struct FusedAdamLaunchArgs {
  AdamHyperParams hyper;
  AdamCoefficients coefficients;  // folded on the host from hyper; used when no device lr/step
  const float* lr;
  const float* inv_grad_scale;
  const float* found_inf;
  int64_t chunk_elements;
  int32_t num_blocks;
  void* param[kFusedAdamMaxTensors];
  const void* grad[kFusedAdamMaxTensors];
  void* exp_avg[kFusedAdamMaxTensors];
  void* exp_avg_sq[kFusedAdamMaxTensors];
  const float* step[kFusedAdamMaxTensors];
  int64_t numel[kFusedAdamMaxTensors];
  int32_t block_chunk[kFusedAdamMaxBlocks];
  uint8_t block_slot[kFusedAdamMaxBlocks];
};

static_assert(sizeof(FusedAdamLaunchArgs) <= kKernelArgumentBytesLimit,
              "the fused Adam argument block must fit the kernel parameter limit");
static_assert(std::is_trivially_copyable<FusedAdamLaunchArgs>::value,
              "kernel arguments are copied bytewise");
static_assert(kFusedAdamMaxTensors <= 256, "block_slot is one byte");

// Plans `call` with `capacity` (at most the argument block's) and fills one argument block per
// launch. Throws std::invalid_argument for a capacity beyond the argument block's.
std::vector<FusedAdamLaunchArgs> encode_fused_adam_launches(const FusedAdamCall& call,
                                                            const MultiTensorCapacity& capacity);

}  // namespace deepspeed_cpp
