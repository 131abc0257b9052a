// The CUDA kernel: one thread block per (tensor, chunk) of the argument block's table. All the
// arithmetic lives in fused_adam_chunk.h, which the host test driver runs on the CPU. Compiled
// with --fmad=false so that nvcc does not contract a*b+c where the CPU kernels do not (see
// common/adam_math.h): the device gives the CPU's bits.
#include <cuda_runtime.h>

#include "fused_adam_chunk.h"
#include "fused_adam_cuda.h"

namespace deepspeed_cpp {
namespace {

// __grid_constant__: the 4 KiB argument block is read in place from the parameter space instead
// of being copied into each thread's local memory when the body takes its address.
template <typename Param, typename Grad, typename State>
__global__ void __launch_bounds__(kFusedAdamBlockThreads)
    fused_adam_kernel(const __grid_constant__ FusedAdamLaunchArgs args) {
  __shared__ AdamCoefficients coefficients;
  if (threadIdx.x == 0) {
    coefficients = block_coefficients(args, blockIdx.x);
  }
  __syncthreads();
  adam_chunk<Param, Grad, State>(args, blockIdx.x, coefficients, threadIdx.x, blockDim.x);
}

}  // namespace

std::string launch_fused_adam_cuda(const std::vector<FusedAdamLaunchArgs>& launches,
                                   ElementType param_type, ElementType grad_type,
                                   ElementType state_type, void* stream) {
  cudaError_t error = cudaSuccess;
  dispatch_fused_adam_types(
      param_type, grad_type, state_type, [&](auto param, auto grad, auto state) {
        using Param = typename decltype(param)::type;
        using Grad = typename decltype(grad)::type;
        using State = typename decltype(state)::type;
        for (const FusedAdamLaunchArgs& args : launches) {
          fused_adam_kernel<Param, Grad, State>
              <<<args.num_blocks, kFusedAdamBlockThreads, 0, static_cast<cudaStream_t>(stream)>>>(
                  args);
          error = cudaGetLastError();
          if (error != cudaSuccess) {
            return;
          }
        }
      });
  return error == cudaSuccess ? std::string() : std::string(cudaGetErrorString(error));
}

}  // namespace deepspeed_cpp
