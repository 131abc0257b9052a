#include "multi_tensor_plan.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace deepspeed_cpp {

std::vector<PlannedLaunch> plan_multi_tensor_launches(const std::vector<int64_t>& numels,
                                                      const MultiTensorCapacity& capacity) {
  if (capacity.chunk_elements < 1) {
    throw std::invalid_argument("multi-tensor plan: chunk_elements must be >= 1, got " +
                                std::to_string(capacity.chunk_elements));
  }
  if (capacity.max_tensors < 1 || capacity.max_blocks < 1) {
    throw std::invalid_argument("multi-tensor plan: max_tensors and max_blocks must be >= 1, got " +
                                std::to_string(capacity.max_tensors) + " and " +
                                std::to_string(capacity.max_blocks));
  }
  // Every count is checked before any is planned: a bad tensor after a huge one is refused at
  // once, not after planning billions of blocks for the huge one.
  constexpr int64_t kMaxChunks = std::numeric_limits<int32_t>::max();
  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t numel = numels[t];
    if (numel < 0) {
      throw std::invalid_argument("multi-tensor plan: tensor " + std::to_string(t) + " has " +
                                  std::to_string(numel) + " elements");
    }
    const int64_t chunks = numel == 0 ? 0 : (numel - 1) / capacity.chunk_elements + 1;
    if (chunks > kMaxChunks) {
      throw std::invalid_argument("multi-tensor plan: tensor " + std::to_string(t) + " has " +
                                  std::to_string(numel) + " elements, " + std::to_string(chunks) +
                                  " chunks of " + std::to_string(capacity.chunk_elements) +
                                  "; at most " + std::to_string(kMaxChunks) +
                                  " chunks can be numbered");
    }
  }
  std::vector<PlannedLaunch> launches;
  PlannedLaunch current;
  const auto close_current = [&]() {
    if (!current.blocks.empty()) {
      launches.push_back(std::move(current));
    }
    current = PlannedLaunch{};
  };

  for (size_t t = 0; t < numels.size(); ++t) {
    const int64_t numel = numels[t];
    if (numel == 0) {
      continue;
    }
    const int64_t chunks = (numel - 1) / capacity.chunk_elements + 1;
    for (int64_t chunk = 0; chunk < chunks; ++chunk) {
      // A tensor needs a slot in the current launch before its first block there; a full table
      // or a full set of slots closes the launch and the tensor continues in the next one.
      const bool has_slot = !current.tensors.empty() && current.tensors.back() == int64_t(t);
      const bool slots_full = int(current.tensors.size()) == capacity.max_tensors;
      const bool table_full = int(current.blocks.size()) == capacity.max_blocks;
      if (table_full || (!has_slot && slots_full)) {
        close_current();
      }
      if (current.tensors.empty() || current.tensors.back() != int64_t(t)) {
        current.tensors.push_back(int64_t(t));
      }
      current.blocks.push_back(
          PlannedBlock{int32_t(current.tensors.size() - 1), static_cast<int32_t>(chunk)});
    }
  }
  close_current();
  return launches;
}

}  // namespace deepspeed_cpp
