// Torch-free planning of ZeRO's flat buckets: which parameter goes where.
#pragma once

#include <cstdint>
#include <vector>

namespace deepspeed_cpp {

// Where one parameter lives in the flat buffers.
struct ParamSlot {
  int64_t bucket;
  int64_t offset;  // element offset inside the bucket
};

struct BucketPlan {
  std::vector<ParamSlot> slots;        // one per parameter, in input order
  std::vector<int64_t> bucket_sizes;   // padded element count of each bucket
  std::vector<int64_t> bucket_groups;  // the parameter group every member of a bucket belongs to
};

// Packs parameters, in the given order, into buckets of at most `capacity` elements (a larger
// parameter gets a bucket of its own). A bucket never mixes parameter groups, so every slice of
// it can be stepped with one set of hyper-parameters. Each bucket is padded to a multiple of
// world_size * alignment elements, so that it splits into world_size equal, aligned shards.
// A parameter with a non-zero `alone[i]` gets a bucket to itself whatever its size (ZeRO-3's
// partitioned parameters: a bucket's shard is that parameter's shard); `alone` may be empty (no
// such parameter). The plan depends only on its inputs: every rank computes the same one.
BucketPlan plan_buckets(const std::vector<int64_t>& numels, const std::vector<int64_t>& groups,
                        const std::vector<int64_t>& alone, int64_t capacity, int64_t world_size,
                        int64_t alignment);

}  // namespace deepspeed_cpp
