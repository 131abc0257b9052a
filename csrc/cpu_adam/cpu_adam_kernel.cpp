#include "cpu_adam_kernel.h"

#include <omp.h>

#include <algorithm>

#include "../common/cpu_isa.h"

namespace deepspeed_cpp {
namespace {

// Elements per work item: large enough to amortise scheduling, small enough (4 arrays x 64 KiB)
// to balance many small tensors over threads. A multiple of every vector width.
constexpr int64_t kChunkElements = 16384;

using RangeFn = void (*)(float*, const float*, float*, float*, int64_t, const AdamCoefficients&);

// The loop every ISA level runs. It is force-inlined into one wrapper per level so that GCC
// vectorises it with that level's registers and turns fmaf into FMA instructions where the level
// has them (the scalar level calls the correctly rounded libm fmaf: slower, same bits).
__attribute__((always_inline)) inline void adam_range(float* __restrict__ param,
                                                      const float* __restrict__ grad,
                                                      float* __restrict__ exp_avg,
                                                      float* __restrict__ exp_avg_sq, int64_t n,
                                                      const AdamCoefficients& coefficients) {
  const AdamCoefficients c = coefficients;
#pragma GCC unroll 4
#pragma GCC ivdep
  for (int64_t i = 0; i < n; ++i) {
    adam_update_element(param[i], grad[i], exp_avg[i], exp_avg_sq[i], c);
  }
}

void adam_range_scalar(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                       int64_t n, const AdamCoefficients& c) {
  adam_range(param, grad, exp_avg, exp_avg_sq, n, c);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void adam_range_avx2(float* param, const float* grad,
                                                         float* exp_avg, float* exp_avg_sq,
                                                         int64_t n, const AdamCoefficients& c) {
  adam_range(param, grad, exp_avg, exp_avg_sq, n, c);
}

__attribute__((target("avx512f,avx512vl,prefer-vector-width=512"))) void adam_range_avx512(
    float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
    const AdamCoefficients& c) {
  adam_range(param, grad, exp_avg, exp_avg_sq, n, c);
}
#endif

RangeFn select_range_fn() {
  switch (selected_cpu_isa()) {
#if defined(__x86_64__)
    case CpuIsa::kAvx512:
      return adam_range_avx512;
    case CpuIsa::kAvx2:
      return adam_range_avx2;
#endif
    default:
      return adam_range_scalar;
  }
}

struct WorkItem {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

}  // namespace

void cpu_adam_update(const std::vector<AdamTensorView>& tensors, const AdamHyperParams& hp) {
  const AdamCoefficients coefficients = make_adam_coefficients(hp);
  const RangeFn range = select_range_fn();

  std::vector<WorkItem> work;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (int64_t begin = 0; begin < tensors[t].numel; begin += kChunkElements) {
      work.push_back(
          {static_cast<int32_t>(t), begin, std::min(begin + kChunkElements, tensors[t].numel)});
    }
  }
  const int64_t num_items = static_cast<int64_t>(work.size());
  // Small steps are not worth waking the thread team for.
  const bool parallel = num_items > 1 && omp_get_max_threads() > 1;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t w = 0; w < num_items; ++w) {
    const WorkItem& item = work[w];
    const AdamTensorView& t = tensors[item.tensor];
    range(t.param + item.begin, t.grad + item.begin, t.exp_avg + item.begin,
          t.exp_avg_sq + item.begin, item.end - item.begin, coefficients);
  }
}

const char* cpu_adam_isa_name() { return cpu_isa_name(selected_cpu_isa()); }

}  // namespace deepspeed_cpp
