// Which tensors and chunks go into which kernel launch, for multi-tensor apply. Torch-free.
//
// A launch passes its tensors' addresses by value in the kernel's argument block, which has a
// fixed capacity of tensor slots and of blocks. Every tensor is cut into fixed-size chunks and
// every chunk is one thread block; the plan lists, per launch, the tensors in its slots and, per
// block, the (slot, chunk) it works on. A launch is closed when its slots or its block table are
// full, so a large tensor spans several launches (it takes a slot in each).
#pragma once

#include <cstdint>
#include <vector>

namespace deepspeed_cpp {

struct MultiTensorCapacity {
  int64_t chunk_elements;  // elements per chunk (= per thread block)
  int max_tensors;         // tensor slots in one launch's argument block
  int max_blocks;          // entries of one launch's block table
};

struct PlannedBlock {
  int32_t slot;  // index into PlannedLaunch::tensors
  int32_t
      chunk;  // the chunk of that tensor: elements [chunk * chunk_elements, ... + chunk_elements)
};

struct PlannedLaunch {
  std::vector<int64_t> tensors;  // index of each slot's tensor in the caller's list
  std::vector<PlannedBlock> blocks;
};

// Plans launches covering every element of every tensor exactly once, in list order. Tensors with
// no elements get no slot. Throws std::invalid_argument, naming the value, when a capacity is out
// of range or a tensor has more chunks than a block table entry can number (2^31 - 1).
std::vector<PlannedLaunch> plan_multi_tensor_launches(const std::vector<int64_t>& numels,
                                                      const MultiTensorCapacity& capacity);

}  // namespace deepspeed_cpp
