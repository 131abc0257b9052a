// The ZeRO gradient reducer: gradients are copied into fixed, pre-planned flat buckets as autograd
// produces them, and every complete bucket is reduced with one asynchronous collective on a c10d
// ProcessGroup, so that communication overlaps the rest of the backward pass.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <string>
#include <vector>

#include "reducer_buffers.h"

// Declared, not included: c10d's ProcessGroup.hpp alone takes ~13 s to compile, and only
// grad_reducer.cpp calls into the group; the op registration (zero_op.cpp) sees pointers only.
namespace c10d {
class ProcessGroup;
class Work;
}  // namespace c10d

namespace deepspeed_cpp {

class GradientReducer : public torch::CustomClassHolder {
 public:
  // `param_bucket`, `param_offset` and `bucket_sizes` are a plan from zero_plan_buckets (the same
  // on every rank). With `scatter`, each rank receives only its 1/world_size shard of each reduced
  // bucket (ZeRO 1/2); without, the whole reduced bucket (ZeRO 0). Gradients are reduced in fp32
  // with SUM whatever their dtype: exact for every dtype and needs nothing a backend may lack
  // (gloo has neither bf16 reductions nor AVG). The caller divides by the world size.
  //
  // `scatter_method` says how a scattered bucket is reduced: "reduce_scatter" (the backend's own;
  // an error where it has none), "all_reduce" (all-reduce, then keep the rank's slice) or "auto":
  // all-reduce on gloo, whose all-reduce is faster than its own reduce-scatter (1.4x with
  // 6M-element buckets on 2 CPU processes, 1.9x on 3: benchmarks/bench_collectives.py),
  // reduce-scatter on other backends that have it. `device` ("cpu", "cuda:0", ...) is where
  // gradients live: it picks the group's backend, every bucket buffer and reduced shard is
  // allocated there, and gradients and destinations on any other device are refused.
  GradientReducer(const std::string& group_name, std::vector<int64_t> param_bucket,
                  std::vector<int64_t> param_offset, std::vector<int64_t> param_numel,
                  std::vector<int64_t> bucket_sizes, bool scatter,
                  const std::string& scatter_method, const std::string& device);
  // Defined where c10d's types are complete (their intrusive_ptrs are released here).
  ~GradientReducer() override;

  // Lays buckets out rank by rank (see ReducerBuffers::set_rank_major): ZeRO-3 reduces one unit's
  // gradients with one collective straight into the concatenation of its parameters' shards.
  void lay_out_rank_major(std::vector<int64_t> param_shard_numel);

  // Hands over parameter `param`'s gradient for this step (copied, converted to fp32; the caller
  // may free it). It must be on the reducer's device.
  void add_grad(int64_t param, const at::Tensor& grad);

  // Reduces what has not been reduced yet (parameters that got no gradient count as zeros),
  // waits for every collective and returns one fp32 tensor per bucket: the rank's shard
  // (scatter) or the whole bucket, or the destination it went into (see accumulate_into).
  // Resets the reducer for the next step.
  std::vector<at::Tensor> finish();

  // From now on each reduced bucket goes straight into `destinations[b]` (fp32 on the reducer's
  // device, the size of the rank's shard, or of the bucket without scatter; a destination
  // elsewhere, such as CPU-offloaded shard gradients, is refused rather than copied each step,
  // so that such a copy stays visible to its caller) as it completes: `destination += scale *
  // reduced`, or `destination = scale * reduced` for the next step after set_overwrite(true).
  // Nothing reduced is then kept until finish(). ZeRO's shard gradients are the destinations.
  void accumulate_into(std::vector<at::Tensor> destinations, double scale);
  void set_overwrite(bool overwrite) { overwrite_ = overwrite; }

  // Whether any gradient arrived since the last finish().
  bool pending() const { return received_ > 0; }

  // How many leading buckets (0 .. harvested()-1) have their reduction complete and, with
  // destinations, added into them during this backward. Buckets are harvested strictly in index
  // order, so these buckets' destinations are final for the step once the micro-step is the
  // accumulation boundary: the caller may use them before finish() (ZeRO-Offload steps their
  // optimizer sub-groups while backward goes on). finish() harvests the rest and resets it to 0.
  int64_t harvested() const { return static_cast<int64_t>(next_to_harvest_); }

  // How buckets are reduced on this group: "reduce_scatter", "all_reduce+slice" (see the
  // constructor) or "all_reduce" (whole buckets, no scatter).
  std::string collective() const;

  // Bytes of bucket buffers and reduced shards the reducer holds now (0 between steps: nothing
  // full-size is kept), and the most it has held at once since it was built.
  int64_t held_bytes() const { return held_bytes_; }
  int64_t peak_held_bytes() const { return peak_held_bytes_; }
  // Buffers of reduced buckets kept for the next ones (ReducerBuffers::recycle): at most three,
  // what a backward holds at once anyway; not counted in held_bytes.
  int64_t spare_bytes() const { return buffers_.spare_bytes(); }

  // With `scatter` or destinations, at most this many launched reductions are left in flight:
  // launching one more first waits for the oldest and keeps only its shard (or adds it into its
  // destination). Buckets therefore do not all stay
  // full-size until finish() (which would hold a full fp32 copy of the gradients), while two in
  // flight keep the backend busy.
  static constexpr size_t kMaxReductionsInFlight = 2;

  int64_t rank() const { return rank_; }
  int64_t world_size() const { return world_size_; }
  int64_t num_buckets() const { return buffers_.num_buckets(); }
  std::string device() const { return buffers_.device().str(); }

 private:
  // What the reducer adds to each of buffers_'s buckets (whose buffer is allocated on first use
  // and released once reduced).
  struct Bucket {
    at::Tensor shard;   // the native reduce-scatter's output
    at::Tensor result;  // what finish() returns for this bucket, once harvested
    c10::intrusive_ptr<c10d::Work> work;
  };

  void launch_complete_buckets_in_order();
  void launch(size_t bucket_index);
  // Waits for the bucket's reduction and keeps its result (or adds it into the bucket's
  // destination), releasing the full-size buffer. `copy_slice`: an all-reduced bucket's slice is
  // copied (during backward, so that the buffer can go) rather than returned as a view of it (in
  // finish(), where the caller consumes it).
  void harvest(size_t bucket_index, bool copy_slice);
  void harvest_beyond_window();
  void hold(const at::Tensor& tensor);
  void release(at::Tensor& tensor);
  bool probe_reduce_scatter();
  bool choose_reduce_scatter(const std::string& scatter_method);

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int64_t rank_;
  int64_t world_size_;
  bool scatter_;
  bool has_reduce_scatter_ = false;
  ReducerBuffers buffers_;  // the gradients' device, the plan and this step's bucket buffers
  std::vector<Bucket> buckets_;
  // Collectives must be issued in the same order on every rank, whatever order autograd hands
  // gradients over in: buckets are launched strictly by index, each once it and all before it
  // are complete.
  size_t next_to_launch_ = 0;
  size_t next_to_harvest_ = 0;
  int64_t received_ = 0;
  int64_t held_bytes_ = 0;
  int64_t peak_held_bytes_ = 0;
  std::vector<at::Tensor> destinations_;  // empty: finish() returns the reduced tensors
  double scale_ = 1.0;
  bool overwrite_ = false;
};

}  // namespace deepspeed_cpp
