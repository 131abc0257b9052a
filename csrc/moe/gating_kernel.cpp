#include "gating_kernel.h"

#include <algorithm>
#include <vector>

#include "gating_token.h"

namespace deepspeed_cpp {
namespace moe {

template <typename T>
void route_tokens(const T* logits, const T* noise, const GatingShape& shape, int64_t begin,
                  int64_t end, int64_t* expert, T* prob) {
  const int64_t experts = shape.num_experts;
  for (int64_t t = begin; t < end; ++t) {
    route_token(logits + t * experts, noise == nullptr ? nullptr : noise + t * experts, experts,
                shape.k, expert + t * shape.k, prob + t * shape.k);
  }
}

namespace {

// k = 1 with priorities: per expert, the `capacity` tokens of highest priority are kept.
void keep_by_priority(const int64_t* expert, const double* priority, const GatingShape& shape,
                      bool* kept) {
  std::vector<std::vector<int64_t>> tokens_of(shape.num_experts);
  for (int64_t t = 0; t < shape.num_tokens; ++t) {
    tokens_of[expert[t]].push_back(t);
    kept[t] = true;
  }
  for (std::vector<int64_t>& tokens : tokens_of) {
    if (shape.capacity < 0 || static_cast<int64_t>(tokens.size()) <= shape.capacity) {
      continue;
    }
    const auto first = [priority](int64_t a, int64_t b) {
      return priority_before(priority[a], a, priority[b], b);
    };
    std::nth_element(tokens.begin(), tokens.begin() + shape.capacity, tokens.end(), first);
    for (auto it = tokens.begin() + shape.capacity; it != tokens.end(); ++it) {
      kept[*it] = false;
    }
  }
}

}  // namespace

void assign_positions(const int64_t* expert, const double* priority, const GatingShape& shape,
                      int64_t* position, bool* kept, int64_t* slot_counts) {
  const int k = shape.k;
  std::fill(slot_counts, slot_counts + k * shape.num_experts, int64_t{0});
  if (priority != nullptr) {
    keep_by_priority(expert, priority, shape, kept);
  }
  // Running count per expert, carried from slot 0 into slot 1.
  std::vector<int64_t> filled(shape.num_experts, 0);
  for (int slot = 0; slot < k; ++slot) {
    for (int64_t t = 0; t < shape.num_tokens; ++t) {
      const int64_t i = t * k + slot;
      const int64_t e = expert[i];
      slot_counts[slot * shape.num_experts + e] += 1;
      if (priority == nullptr) {
        kept[i] = shape.capacity < 0 || filled[e] < shape.capacity;
      }
      position[i] = kept[i] ? filled[e]++ : -1;
      // Without priorities a dropped choice still takes its place in the cumulative count (as
      // DeepSpeed's cumsum does), so that later tokens of that expert are dropped too.
      filled[e] += (!kept[i] && priority == nullptr) ? 1 : 0;
    }
  }
}

template <typename T>
void combine_tokens(const T* prob, const bool* kept, int k, int64_t begin, int64_t end, T* weight) {
  for (int64_t t = begin; t < end; ++t) {
    combine_token(prob + t * k, kept + t * k, k, weight + t * k);
  }
}

template <typename T>
void combine_tokens_backward(const T* grad_weight, const T* logits, const int64_t* expert,
                             const bool* kept, const GatingShape& shape, int64_t begin, int64_t end,
                             T* grad_logits) {
  const int64_t experts = shape.num_experts;
  const int k = shape.k;
  for (int64_t t = begin; t < end; ++t) {
    combine_token_backward(grad_weight + t * k, logits + t * experts, experts, expert + t * k,
                           kept + t * k, k, grad_logits + t * experts);
  }
}

#define DS_MOE_INSTANTIATE(T)                                                               \
  template void route_tokens<T>(const T*, const T*, const GatingShape&, int64_t, int64_t,   \
                                int64_t*, T*);                                              \
  template void combine_tokens<T>(const T*, const bool*, int, int64_t, int64_t, T*);        \
  template void combine_tokens_backward<T>(const T*, const T*, const int64_t*, const bool*, \
                                           const GatingShape&, int64_t, int64_t, T*);
DS_MOE_INSTANTIATE(float)
DS_MOE_INSTANTIATE(double)
#undef DS_MOE_INSTANTIATE

}  // namespace moe
}  // namespace deepspeed_cpp
