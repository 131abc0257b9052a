#include "bucket_plan.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace deepspeed_cpp {
namespace {

constexpr int64_t kMaxElements = std::numeric_limits<int64_t>::max();

// A bucket's padded size; a bucket of only empty tensors still gets one element per shard.
// Sizes near the int64 limit are refused here rather than wrapped round (undefined behaviour).
int64_t padded_size(int64_t used, int64_t multiple) {
  const int64_t at_least_one = used > 0 ? used : 1;
  // The padding actually needed, not multiple - 1: a size whose padded value still fits is kept.
  const int64_t remainder = at_least_one % multiple;
  const int64_t padding = remainder == 0 ? 0 : multiple - remainder;
  if (at_least_one > kMaxElements - padding) {
    throw std::invalid_argument("plan_buckets: a bucket of " + std::to_string(at_least_one) +
                                " elements cannot be padded to a multiple of " +
                                std::to_string(multiple) + " within int64");
  }
  return at_least_one + padding;
}

}  // namespace

BucketPlan plan_buckets(const std::vector<int64_t>& numels, const std::vector<int64_t>& groups,
                        const std::vector<int64_t>& alone, int64_t capacity, int64_t world_size,
                        int64_t alignment) {
  if (numels.size() != groups.size()) {
    throw std::invalid_argument("plan_buckets: numels has " + std::to_string(numels.size()) +
                                " entries but groups has " + std::to_string(groups.size()));
  }
  if (!alone.empty() && alone.size() != numels.size()) {
    throw std::invalid_argument("plan_buckets: alone has " + std::to_string(alone.size()) +
                                " entries; expected none or one per parameter (" +
                                std::to_string(numels.size()) + ")");
  }
  if (capacity < 1 || world_size < 1 || alignment < 1) {
    throw std::invalid_argument(
        "plan_buckets: capacity, world_size and alignment must be >= 1, got " +
        std::to_string(capacity) + ", " + std::to_string(world_size) + ", " +
        std::to_string(alignment));
  }
  if (world_size > kMaxElements / alignment) {
    throw std::invalid_argument("plan_buckets: world_size * alignment (" +
                                std::to_string(world_size) + " * " + std::to_string(alignment) +
                                ") overflows int64");
  }
  const int64_t multiple = world_size * alignment;
  BucketPlan plan;
  plan.slots.reserve(numels.size());
  int64_t used = 0;            // elements in the open bucket
  bool open_is_alone = false;  // the open bucket holds a parameter that stays alone
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) {
      throw std::invalid_argument("plan_buckets: numels[" + std::to_string(i) + "] is negative");
    }
    const bool is_alone = !alone.empty() && alone[i] != 0;
    const bool open = !plan.bucket_groups.empty();
    // `numels[i] <= capacity - used` rather than `used + numels[i] <= capacity`: no overflow.
    const bool fits = open && !open_is_alone && !is_alone &&
                      plan.bucket_groups.back() == groups[i] && numels[i] <= capacity - used;
    open_is_alone = is_alone;  // a parameter that fits joins a bucket that is not alone
    if (!fits) {
      if (open) plan.bucket_sizes.push_back(padded_size(used, multiple));
      plan.bucket_groups.push_back(groups[i]);
      used = 0;
    }
    plan.slots.push_back({static_cast<int64_t>(plan.bucket_groups.size()) - 1, used});
    used += numels[i];
  }
  if (!plan.bucket_groups.empty()) {
    plan.bucket_sizes.push_back(padded_size(used, multiple));
  }
  return plan;
}

}  // namespace deepspeed_cpp
