// Lets one inline function be compiled for the CPU and for CUDA devices.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define DS_HOST_DEVICE __host__ __device__
#else
#define DS_HOST_DEVICE
#endif
