// Torch-free CPU Adam kernel: raw pointers, sizes and a hyper-parameter struct.
#pragma once

#include <cstdint>
#include <vector>

#include "../common/adam_math.h"

namespace deepspeed_cpp {

// One contiguous fp32 tensor's worth of Adam state.
struct AdamTensorView {
  float* param;
  const float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  int64_t numel;
};

// Updates every tensor in `tensors` in one parallel region. Work is cut into fixed-size chunks
// that do not depend on the thread count, and every element goes through adam_update_element,
// so results are bitwise identical for any number of threads and any ISA level.
void cpu_adam_update(const std::vector<AdamTensorView>& tensors, const AdamHyperParams& hp);

// Name of the ISA level the kernel runs at in this process ("avx512", "avx2" or "scalar").
const char* cpu_adam_isa_name();

}  // namespace deepspeed_cpp
