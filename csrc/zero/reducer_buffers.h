// The bucket buffers of the ZeRO gradient reducer, apart from any communication: where they are
// allocated, how they are padded and which gradients may be copied into them. Kept free of c10d
// so that every allocation and device decision can be exercised with no process group, on the
// `meta` device (tests/test_reducer_device.py, through the ReducerBuffers class in zero_op.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <vector>

namespace deepspeed_cpp {

class ReducerBuffers {
 public:
  // A plan from zero_plan_buckets (see GradientReducer) and the device the gradients live on:
  // every buffer is a float32 tensor on `device`, whatever the device of the caller's tensors.
  ReducerBuffers(std::vector<int64_t> param_bucket, std::vector<int64_t> param_offset,
                 std::vector<int64_t> param_numel, std::vector<int64_t> bucket_sizes,
                 c10::Device device);

  // "cpu", "cuda:0", "meta", ... as a device tensors compare equal to. Needs no accelerator,
  // except that a bare accelerator type ("cuda") is pinned to the current device of that type:
  // gradients always carry an index, so an unpinned device would never match them.
  static c10::Device parse_device(const std::string& device);

  const c10::Device& device() const { return device_; }
  int64_t num_params() const { return static_cast<int64_t>(param_bucket_.size()); }
  int64_t num_buckets() const { return static_cast<int64_t>(buckets_.size()); }
  int64_t bucket_size(int64_t bucket) const { return buckets_[bucket].size; }
  int64_t bucket_of(int64_t param) const { return param_bucket_[param]; }

  // Copies `param`'s gradient (any dtype, converted to float32) into its bucket's buffer,
  // allocating the buffer first if needed. A gradient on another device than the buffers' is
  // refused: moving it (or the buffer) silently would cost a full copy on every step.
  // Returns whether a buffer was allocated, for the caller's memory accounting.
  bool add_grad(int64_t param, const at::Tensor& grad);

  // Lays some buckets out rank by rank, as ZeRO-3 keeps a unit's parameters: a parameter `p` with
  // `param_shard_numel[p]` > 0 is split into `world_size` pieces of that many elements (its last
  // ones zero-padded), and piece r goes to element `param_offset[p]` of the bucket's shard r. A
  // bucket's members must be all rank-major or all not, and a rank-major bucket's members must
  // tile its shard exactly; then one reduce-scatter hands rank r every member's piece r, back to
  // back. Called before any gradient is handed over.
  void set_rank_major(const std::vector<int64_t>& param_shard_numel, int64_t world_size);

  // Whether every member of `bucket` has been handed over (or zero-filled) in this step.
  bool complete(int64_t bucket) const {
    return buckets_[bucket].arrived == static_cast<int64_t>(buckets_[bucket].members.size());
  }

  // Completes `bucket` with zeros for the members that got no gradient in this step (unused
  // parameters count as zero gradients). Returns whether a buffer was allocated.
  bool fill_missing(int64_t bucket);

  // The bucket's buffer: undefined before the first gradient of the step and after release().
  at::Tensor& buffer(int64_t bucket) { return buckets_[bucket].buffer; }

  // Takes back `bucket`'s buffer once its reduction was added into the caller's destination
  // (nothing else refers to it then) and keeps it for a later bucket, instead of freeing it and
  // allocating the next one afresh: a host allocation of a bucket's size often comes from fresh
  // pages (glibc gives the top of its heap back, or maps it anew), written page fault by page
  // fault (~2.7 us each on the CI machine; ZeRO-3's unit buckets of the 50M transformer, 2 ranks:
  // 14-24K faults per step before, 1-3K after, benchmarks/zero3_step_profile.py).
  // At most kMaxSpareBuffers are kept (the largest), what a backward holds at once anyway
  // (GradientReducer: the buffer filling and the reductions in flight).
  void recycle(int64_t bucket);
  static constexpr size_t kMaxSpareBuffers = 3;
  int64_t spare_bytes() const;

  // Fails unless `destination` is a contiguous 1-D float32 tensor of `numel` elements on the
  // buffers' device: reduced buckets are added into it in place, without a copy between devices.
  void check_destination(int64_t bucket, const at::Tensor& destination, int64_t numel) const;

  // Forgets this step's gradients: no bucket keeps a buffer (the recycled ones stay spare) and
  // every parameter is expected again.
  void reset();

 private:
  struct Bucket {
    int64_t size = 0;  // padded elements
    int64_t used = 0;  // elements covered by parameters; the rest is zero padding
    std::vector<int64_t> members;
    int64_t arrived = 0;
    at::Tensor buffer;
    at::Tensor whole;  // what `buffer` views: a spare may be larger than the bucket
  };

  bool ensure_buffer(Bucket& bucket);
  // The smallest spare of at least `numel` elements (taken out of spare_), or undefined.
  at::Tensor take_spare(int64_t numel);
  // Where `param`'s gradient goes in its bucket's buffer: a contiguous slice, or for a rank-major
  // parameter a [world_size, shard] view, one row per rank.
  at::Tensor slot(int64_t param, const at::Tensor& buffer) const;

  c10::Device device_;
  std::vector<int64_t> param_bucket_;
  std::vector<int64_t> param_offset_;
  std::vector<int64_t> param_numel_;
  std::vector<int64_t> param_shard_;  // 0: contiguous; else rank-major, this many per rank
  int64_t world_size_ = 1;            // of the rank-major layout
  std::vector<char> param_arrived_;
  std::vector<Bucket> buckets_;
  std::vector<at::Tensor> spare_;  // flat float32 buffers on device_, largest first
};

}  // namespace deepspeed_cpp
