// The loop every CPU optimizer runs over one range of one tensor, written once over a lane type
// (cpu_simd_*.h) and an optimizer (a struct with kStates, Coefficients, Lanes<L> and update<L>),
// and the table that maps run-time storage types to its instantiations.
//
// Include only inside the target region of one ISA level (cpu_<family>_<isa>.cpp): everything
// here is compiled for that level, in an unnamed namespace so that no two levels share code.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_low_precision.h"
#include "cpu_optimizer_streams.h"
#include "cpu_simd_scalar.h"

namespace deepspeed_cpp {
namespace cpu_optim {
namespace {

// The absent low-precision copy: storing to it does nothing.
struct NoCopy {};

// How far ahead the loop prefetches, in elements (2 KiB of a float32 stream). Measured on Sapphire
// Rapids with 2 threads: without it the arithmetic delays the loads enough to lose ~10% of the
// bandwidth; the hardware prefetcher alone also stops at every 4 KiB page.
constexpr int64_t kPrefetchElements = 512;
// Elements per prefetch block: one or two cache lines of every stream, a multiple of every width.
constexpr int64_t kBlockElements = 32;

template <class T>
inline void prefetch_block(const T* base, int64_t element) {
  if constexpr (!std::is_same_v<T, NoCopy>) {
    // Address arithmetic on integers: the prefetched block may lie past the end of the tensor,
    // which a prefetch tolerates and pointer arithmetic would not.
    const uintptr_t address = reinterpret_cast<uintptr_t>(base) + uintptr_t(element) * sizeof(T);
    for (int64_t byte = 0; byte < kBlockElements * int64_t(sizeof(T)); byte += 64) {
      __builtin_prefetch(reinterpret_cast<const void*>(address + uintptr_t(byte)), 0, 3);
    }
  }
}

template <class L, class T>
inline typename L::F load_lanes(const T* p) {
  return L::load(p);
}

template <class L, class T>
inline void store_lanes(T* p, typename L::F value) {
  if constexpr (!std::is_same_v<T, NoCopy>) L::store(p, value);
}

// One group of L::kWidth elements starting at i: load and widen, update in float, round and store.
template <class L, class Opt, class P, class G, class S, class C>
__attribute__((always_inline)) inline void update_lanes(
    P* param, const G* grad, S* const* state, C* copy, int64_t i,
    const typename Opt::template Lanes<L>& lanes, typename L::F grad_multiplier) {
  using F = typename L::F;
  F p = load_lanes<L>(param + i);
  const F g = L::mul(load_lanes<L>(grad + i), grad_multiplier);
  F s[Opt::kStates];
  for (int k = 0; k < Opt::kStates; ++k) s[k] = load_lanes<L>(state[k] + i);
  Opt::template update<L>(p, g, s, lanes);
  store_lanes<L>(param + i, p);
  for (int k = 0; k < Opt::kStates; ++k) store_lanes<L>(state[k] + i, s[k]);
  if constexpr (!std::is_same_v<C, NoCopy>) store_lanes<L>(copy + i, p);
}

template <class L, class Opt, class P, class G, class S, class C>
void update_range(const OptimizerTensor& tensor, int64_t begin, int64_t end,
                  const typename Opt::Coefficients& coefficients, float grad_multiplier) {
  P* const param = static_cast<P*>(tensor.param);
  const G* const grad = static_cast<const G*>(tensor.grad);
  S* state[Opt::kStates];
  for (int k = 0; k < Opt::kStates; ++k) state[k] = static_cast<S*>(tensor.state[k]);
  C* const copy = static_cast<C*>(tensor.param_lowp);
  const typename Opt::template Lanes<L> lanes(coefficients);
  const typename Opt::template Lanes<ScalarLanes> scalar_lanes(coefficients);
  const typename L::F multiplier = L::broadcast(grad_multiplier);

  int64_t i = begin;
  for (; i + kBlockElements <= end; i += kBlockElements) {
    prefetch_block(param, i + kPrefetchElements);
    prefetch_block(grad, i + kPrefetchElements);
    for (int k = 0; k < Opt::kStates; ++k) prefetch_block(state[k], i + kPrefetchElements);
    for (int64_t j = 0; j < kBlockElements; j += L::kWidth) {
      update_lanes<L, Opt>(param, grad, state, copy, i + j, lanes, multiplier);
    }
  }
  // The tail goes one element at a time through the same operations: same bits.
  for (; i < end; ++i) {
    update_lanes<ScalarLanes, Opt>(param, grad, state, copy, i, scalar_lanes, grad_multiplier);
  }
}

template <class L, class G>
bool range_has_nonfinite(const void* grad_pointer, int64_t begin, int64_t end,
                         float grad_multiplier) {
  const G* const grad = static_cast<const G*>(grad_pointer);
  const typename L::F multiplier = L::broadcast(grad_multiplier);
  const typename L::F zero = L::broadcast(0.0f);
  // x * 0 is 0 for finite x and NaN otherwise, so one NaN check at the end covers the range.
  typename L::F accumulated = zero;
  int64_t i = begin;
  for (; i + L::kWidth <= end; i += L::kWidth) {
    accumulated = L::fma(L::mul(L::load(grad + i), multiplier), zero, accumulated);
  }
  float tail = 0.0f;
  for (; i < end; ++i) tail = std::fmaf(load_as_float(grad + i) * grad_multiplier, 0.0f, tail);
  return L::any_nonfinite(accumulated) || ScalarLanes::any_nonfinite(tail);
}

// --- run-time storage types -> instantiation ---------------------------------------------------

template <class L, class Opt, class P, class G, class S>
RangeUpdateFn<typename Opt::Coefficients> pick_copy(ElementType copy) {
  if constexpr (std::is_same_v<P, float>) {
    switch (copy) {
      case ElementType::kBFloat16:
        return &update_range<L, Opt, P, G, S, BFloat16Bits>;
      case ElementType::kFloat16:
        return &update_range<L, Opt, P, G, S, Float16Bits>;
      case ElementType::kNone:
        return &update_range<L, Opt, P, G, S, NoCopy>;
      default:
        return nullptr;
    }
  } else {
    // A low-precision parameter is its own low-precision copy.
    return copy == ElementType::kNone ? &update_range<L, Opt, P, G, S, NoCopy> : nullptr;
  }
}

template <class L, class Opt, class P, class G>
RangeUpdateFn<typename Opt::Coefficients> pick_state(const StreamTypes& types) {
  switch (types.state) {
    case ElementType::kFloat32:
      return pick_copy<L, Opt, P, G, float>(types.param_lowp);
    case ElementType::kBFloat16:
      return pick_copy<L, Opt, P, G, BFloat16Bits>(types.param_lowp);
    default:
      return nullptr;
  }
}

template <class L, class Opt, class P>
RangeUpdateFn<typename Opt::Coefficients> pick_grad(const StreamTypes& types) {
  switch (types.grad) {
    case ElementType::kFloat32:
      return pick_state<L, Opt, P, float>(types);
    case ElementType::kBFloat16:
      return pick_state<L, Opt, P, BFloat16Bits>(types);
    case ElementType::kFloat16:
      return pick_state<L, Opt, P, Float16Bits>(types);
    default:
      return nullptr;
  }
}

template <class L>
RangeCheckFn pick_check(ElementType grad) {
  switch (grad) {
    case ElementType::kFloat32:
      return &range_has_nonfinite<L, float>;
    case ElementType::kBFloat16:
      return &range_has_nonfinite<L, BFloat16Bits>;
    case ElementType::kFloat16:
      return &range_has_nonfinite<L, Float16Bits>;
    default:
      return nullptr;
  }
}

// The loops of lane type L and optimizer Opt for `types` (null members where unsupported).
template <class L, class Opt>
RangeKernels<typename Opt::Coefficients> pick_kernels(const StreamTypes& types) {
  RangeKernels<typename Opt::Coefficients> kernels;
  switch (types.param) {
    case ElementType::kFloat32:
      kernels.update = pick_grad<L, Opt, float>(types);
      break;
    case ElementType::kBFloat16:
      kernels.update = pick_grad<L, Opt, BFloat16Bits>(types);
      break;
    case ElementType::kFloat16:
      kernels.update = pick_grad<L, Opt, Float16Bits>(types);
      break;
    default:
      break;
  }
  kernels.check = pick_check<L>(types.grad);
  return kernels;
}

}  // namespace
}  // namespace cpu_optim
}  // namespace deepspeed_cpp
