// The MoE gating CUDA kernels. The per-token arithmetic is gating_token.h, the CPU kernel's own;
// only the capacity scan is device-specific: one thread block per expert walks the tokens in
// order with a block-wide prefix sum. Compiled with --fmad=false (as fused Adam) so that the
// device rounds as the CPU does.
#include <cuda_runtime.h>

#include <cub/block/block_scan.cuh>

#include "gating_cuda.h"
#include "gating_token.h"

namespace deepspeed_cpp {
namespace moe {
namespace {

constexpr int kThreads = 256;

int64_t token_blocks(int64_t tokens) { return (tokens + kThreads - 1) / kThreads; }

template <typename T>
__global__ void route_kernel(const T* logits, const T* noise, GatingShape shape, int64_t* expert,
                             T* prob) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < shape.num_tokens) {
    const int64_t experts = shape.num_experts;
    route_token(logits + t * experts, noise == nullptr ? nullptr : noise + t * experts, experts,
                shape.k, expert + t * shape.k, prob + t * shape.k);
  }
}

// k = 1 with priorities: a token is kept when fewer than `capacity` tokens of its expert come
// before it in the order of priority_before (gating_token.h). O(tokens) per token.
__global__ void keep_by_priority_kernel(const int64_t* expert, const double* priority,
                                        GatingShape shape, bool* kept) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t >= shape.num_tokens) {
    return;
  }
  const int64_t e = expert[t];
  const double mine = priority[t];
  int64_t ahead = 0;
  for (int64_t other = 0; other < shape.num_tokens; ++other) {
    ahead += expert[other] == e && priority_before(priority[other], other, mine, t) ? 1 : 0;
  }
  kept[t] = shape.capacity < 0 || ahead < shape.capacity;
}

// One block per expert: positions in token order, slot 0 before slot 1 (see assign_positions).
// With priorities, `kept` is an input (keep_by_priority_kernel) and only kept tokens count.
__global__ void __launch_bounds__(kThreads)
    positions_kernel(const int64_t* expert, bool by_priority, GatingShape shape, int64_t* position,
                     bool* kept, int64_t* slot_counts) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  const int64_t e = blockIdx.x;
  int64_t filled = 0;  // identical in every thread: it only grows by block aggregates
  for (int slot = 0; slot < shape.k; ++slot) {
    int64_t chosen = 0;
    for (int64_t base = 0; base < shape.num_tokens; base += kThreads) {
      const int64_t t = base + threadIdx.x;
      const int64_t i = t * shape.k + slot;
      const bool mine = t < shape.num_tokens && expert[i] == e;
      const bool counts = mine && (!by_priority || kept[i]);
      int64_t before = 0;
      int64_t counted = 0;
      Scan(scan_storage).ExclusiveSum(static_cast<int64_t>(counts), before, counted);
      __syncthreads();
      int64_t mine_before = 0;
      int64_t mine_total = 0;
      Scan(scan_storage).ExclusiveSum(static_cast<int64_t>(mine), mine_before, mine_total);
      __syncthreads();
      if (mine) {
        const int64_t place = filled + before;
        const bool keep = by_priority ? kept[i] : (shape.capacity < 0 || place < shape.capacity);
        kept[i] = keep;
        position[i] = keep ? place : -1;
      }
      filled += counted;
      chosen += mine_total;
    }
    if (threadIdx.x == 0) {
      slot_counts[slot * shape.num_experts + e] = chosen;
    }
  }
}

template <typename T>
__global__ void combine_kernel(const T* prob, const bool* kept, GatingShape shape, T* weight) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < shape.num_tokens) {
    combine_token(prob + t * shape.k, kept + t * shape.k, shape.k, weight + t * shape.k);
  }
}

template <typename T>
__global__ void backward_kernel(const T* grad_weight, const T* logits, const int64_t* expert,
                                const bool* kept, GatingShape shape, T* grad_logits) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < shape.num_tokens) {
    const int64_t experts = shape.num_experts;
    combine_token_backward(grad_weight + t * shape.k, logits + t * experts, experts,
                           expert + t * shape.k, kept + t * shape.k, shape.k,
                           grad_logits + t * experts);
  }
}

template <typename T>
cudaError_t gating(const T* logits, const T* noise, const double* priority,
                   const GatingShape& shape, int64_t* expert, T* prob, int64_t* position,
                   bool* kept, int64_t* slot_counts, T* weight, cudaStream_t stream) {
  const int64_t blocks = token_blocks(shape.num_tokens);
  if (blocks > 0) {
    route_kernel<T><<<blocks, kThreads, 0, stream>>>(logits, noise, shape, expert, prob);
    if (priority != nullptr) {
      keep_by_priority_kernel<<<blocks, kThreads, 0, stream>>>(expert, priority, shape, kept);
    }
  }
  positions_kernel<<<shape.num_experts, kThreads, 0, stream>>>(expert, priority != nullptr, shape,
                                                               position, kept, slot_counts);
  if (blocks > 0) {
    combine_kernel<T><<<blocks, kThreads, 0, stream>>>(prob, kept, shape, weight);
  }
  return cudaGetLastError();
}

std::string error_text(cudaError_t error) {
  return error == cudaSuccess ? std::string() : std::string(cudaGetErrorString(error));
}

}  // namespace

std::string launch_moe_gating_cuda(const void* logits, const void* noise, const double* priority,
                                   bool is_double, const GatingShape& shape, int64_t* expert,
                                   void* prob, int64_t* position, bool* kept, int64_t* slot_counts,
                                   void* weight, void* stream) {
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (is_double) {
    return error_text(gating(static_cast<const double*>(logits), static_cast<const double*>(noise),
                             priority, shape, expert, static_cast<double*>(prob), position, kept,
                             slot_counts, static_cast<double*>(weight), cuda_stream));
  }
  return error_text(gating(static_cast<const float*>(logits), static_cast<const float*>(noise),
                           priority, shape, expert, static_cast<float*>(prob), position, kept,
                           slot_counts, static_cast<float*>(weight), cuda_stream));
}

std::string launch_moe_gating_backward_cuda(const void* grad_weight, const void* logits,
                                            const int64_t* expert, const bool* kept, bool is_double,
                                            const GatingShape& shape, void* grad_logits,
                                            void* stream) {
  const int64_t blocks = token_blocks(shape.num_tokens);
  if (blocks == 0) {
    return std::string();
  }
  const auto cuda_stream = static_cast<cudaStream_t>(stream);
  if (is_double) {
    backward_kernel<double><<<blocks, kThreads, 0, cuda_stream>>>(
        static_cast<const double*>(grad_weight), static_cast<const double*>(logits), expert, kept,
        shape, static_cast<double*>(grad_logits));
  } else {
    backward_kernel<float><<<blocks, kThreads, 0, cuda_stream>>>(
        static_cast<const float*>(grad_weight), static_cast<const float*>(logits), expert, kept,
        shape, static_cast<float*>(grad_logits));
  }
  return error_text(cudaGetLastError());
}

}  // namespace moe
}  // namespace deepspeed_cpp
