// Runs one optimizer step over a list of tensors in a single OpenMP parallel region.
//
// The tensors are cut into fixed-size work items that do not depend on the thread count, and each
// item runs the same loop whichever thread takes it, so results are bitwise identical for any
// number of threads. With a found_inf flag the gradients are first checked for infinities and NaNs
// in the same region (one thread start-up), and the update is skipped when any is found.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_optimizer_streams.h"

namespace deepspeed_cpp {
namespace cpu_optim {

// Elements per work item: large enough to amortise scheduling, small enough (about 256 KiB of
// float32 streams) to balance lists of many small tensors over the threads. A multiple of every
// vector width and prefetch block.
constexpr int64_t kWorkItemElements = 16384;

struct WorkItem {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

inline std::vector<WorkItem> plan_work_items(const std::vector<OptimizerTensor>& tensors) {
  std::vector<WorkItem> work;
  for (size_t t = 0; t < tensors.size(); ++t) {
    for (int64_t begin = 0; begin < tensors[t].numel; begin += kWorkItemElements) {
      work.push_back(
          {static_cast<int32_t>(t), begin, std::min(begin + kWorkItemElements, tensors[t].numel)});
    }
  }
  return work;
}

// `found_inf` may be null (no check). Otherwise, when *found_inf is already non-zero the step is
// skipped (a flag set by an earlier check, for example on another rank); else the gradients are
// checked, *found_inf is set to 1 or 0, and nothing is written when it is 1.
template <class Coefficients>
void run_multi_tensor_step(const std::vector<OptimizerTensor>& tensors,
                           const RangeKernels<Coefficients>& kernels,
                           const Coefficients& coefficients, float grad_multiplier,
                           float* found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const std::vector<WorkItem> work = plan_work_items(tensors);
  const int64_t num_items = static_cast<int64_t>(work.size());
  const bool check = found_inf != nullptr;
  bool nonfinite = false;
  // Small steps are not worth waking the thread team for.
  const bool parallel = num_items > 1 && omp_get_max_threads() > 1;
#pragma omp parallel if (parallel)
  {
    if (check) {
#pragma omp for schedule(static) reduction(|| : nonfinite)
      for (int64_t w = 0; w < num_items; ++w) {
        const WorkItem& item = work[w];
        nonfinite = nonfinite ||
                    kernels.check(tensors[item.tensor].grad, item.begin, item.end, grad_multiplier);
      }
      // The loop's closing barrier makes the reduced flag visible to every thread.
    }
    if (!nonfinite) {
#pragma omp for schedule(static)
      for (int64_t w = 0; w < num_items; ++w) {
        const WorkItem& item = work[w];
        kernels.update(tensors[item.tensor], item.begin, item.end, coefficients, grad_multiplier);
      }
    }
  }
  if (check) *found_inf = nonfinite ? 1.0f : 0.0f;
}

}  // namespace cpu_optim
}  // namespace deepspeed_cpp
