#include "grad_reducer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>

#include <algorithm>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace deepspeed_cpp {

GradientReducer::~GradientReducer() = default;

GradientReducer::GradientReducer(const std::string& group_name, std::vector<int64_t> param_bucket,
                                 std::vector<int64_t> param_offset,
                                 std::vector<int64_t> param_numel,
                                 std::vector<int64_t> bucket_sizes, bool scatter,
                                 const std::string& scatter_method, const std::string& device)
    : group_(c10d::resolve_process_group(group_name)),
      rank_(group_->getRank()),
      world_size_(group_->getSize()),
      scatter_(scatter),
      buffers_(std::move(param_bucket), std::move(param_offset), std::move(param_numel),
               bucket_sizes, ReducerBuffers::parse_device(device)),
      buckets_(bucket_sizes.size()) {
  for (size_t b = 0; b < bucket_sizes.size(); ++b) {
    // Only a scattered bucket splits into one shard per rank.
    TORCH_CHECK(!scatter_ || bucket_sizes[b] % world_size_ == 0, "GradientReducer: bucket ", b,
                " has size ", bucket_sizes[b], "; expected a positive multiple of the world size ",
                world_size_);
  }
  has_reduce_scatter_ = scatter_ && choose_reduce_scatter(scatter_method);
}

bool GradientReducer::choose_reduce_scatter(const std::string& scatter_method) {
  const c10::Device& device = buffers_.device();
  if (scatter_method == "all_reduce") return false;
  if (scatter_method == "reduce_scatter") {
    TORCH_CHECK(probe_reduce_scatter(),
                "GradientReducer: scatter_method 'reduce_scatter' "
                "was asked for, but the process group's ",
                group_->getBackendName(), " backend has no reduce-scatter on ", device);
    return true;
  }
  TORCH_CHECK(scatter_method == "auto", "GradientReducer: scatter_method must be 'auto', ",
              "'reduce_scatter' or 'all_reduce', got '", scatter_method, "'");
  if (group_->getBackend(device.type())->getBackendName() == "gloo") return false;
  return probe_reduce_scatter();
}

bool GradientReducer::probe_reduce_scatter() {
  // Every rank builds its reducer at the same point, so the probe is a collective like any
  // other. A backend without the op throws before communicating. Allocating is outside the
  // try: failing to allocate on the gradients' device is an error, not a missing op.
  const auto options_on_device = at::TensorOptions().dtype(at::kFloat).device(buffers_.device());
  at::Tensor input = at::ones({world_size_}, options_on_device);
  at::Tensor output = at::empty({1}, options_on_device);
  TORCH_INTERNAL_ASSERT(input.device() == buffers_.device() &&
                        output.device() == buffers_.device());
  try {
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    group_->_reduce_scatter_base(output, input, options)->wait();
    return output.item<float>() == static_cast<float>(world_size_);
  } catch (const c10::Error&) {
    return false;
  }
}

std::string GradientReducer::collective() const {
  if (!scatter_) return "all_reduce";
  return has_reduce_scatter_ ? "reduce_scatter" : "all_reduce+slice";
}

void GradientReducer::hold(const at::Tensor& tensor) {
  held_bytes_ += static_cast<int64_t>(tensor.nbytes());
  peak_held_bytes_ = std::max(peak_held_bytes_, held_bytes_);
}

void GradientReducer::release(at::Tensor& tensor) {
  if (!tensor.defined()) return;
  held_bytes_ -= static_cast<int64_t>(tensor.nbytes());
  tensor = at::Tensor();
}

void GradientReducer::lay_out_rank_major(std::vector<int64_t> param_shard_numel) {
  TORCH_CHECK(received_ == 0, "GradientReducer.lay_out_rank_major: called after ", received_,
              " gradients were handed over in this step");
  buffers_.set_rank_major(param_shard_numel, world_size_);
}

void GradientReducer::add_grad(int64_t param, const at::Tensor& grad) {
  if (buffers_.add_grad(param, grad)) hold(buffers_.buffer(buffers_.bucket_of(param)));
  ++received_;
  launch_complete_buckets_in_order();
}

void GradientReducer::launch_complete_buckets_in_order() {
  while (next_to_launch_ < buckets_.size()) {
    if (!buffers_.complete(static_cast<int64_t>(next_to_launch_))) return;
    launch(next_to_launch_);
    ++next_to_launch_;
    // Without scatter or destinations the reduced buckets are the results: nothing to free early.
    if (scatter_ || !destinations_.empty()) harvest_beyond_window();
  }
}

void GradientReducer::harvest_beyond_window() {
  while (next_to_launch_ - next_to_harvest_ > kMaxReductionsInFlight) {
    harvest(next_to_harvest_, /*copy_slice=*/true);
    ++next_to_harvest_;
  }
}

void GradientReducer::harvest(size_t bucket_index, bool copy_slice) {
  Bucket& bucket = buckets_[bucket_index];
  at::Tensor& buffer = buffers_.buffer(static_cast<int64_t>(bucket_index));
  try {
    bucket.work->wait();
  } catch (const std::exception& error) {
    // The process group's own text (gloo: "Timed out waiting 8000ms for recv operation", a
    // gloo::IoException rather than a c10::Error) names neither the collective nor the bucket;
    // both are known only here.
    const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
    TORCH_CHECK(
        false, "GradientReducer: the ", collective(), " of gradient bucket ", bucket_index, " of ",
        buckets_.size(), " (", buffer.numel(), " elements, world size ", world_size_,
        ") failed: ", c10_error != nullptr ? c10_error->what_without_backtrace() : error.what());
  }
  bucket.work.reset();
  at::Tensor reduced;
  if (has_reduce_scatter_) {
    reduced = bucket.shard;
  } else if (scatter_) {
    const int64_t shard = buffer.numel() / world_size_;
    reduced = buffer.narrow(0, rank_ * shard, shard);
  } else {
    reduced = buffer;
  }
  if (!destinations_.empty()) {
    // accumulate_into checked that the destination is on the reducer's device, as `reduced` is.
    at::Tensor& destination = destinations_[bucket_index];
    // Overwriting gives what adding to zeros would: scale * reduced, rounded once.
    if (overwrite_) {
      at::mul_out(destination, reduced, scale_);
    } else {
      destination.add_(reduced, scale_);
    }
    bucket.result = destination;
    release(bucket.shard);
    // Nothing refers to the buffer now: it is kept for a later bucket (ReducerBuffers::recycle).
    held_bytes_ -= static_cast<int64_t>(buffer.nbytes());
    buffers_.recycle(static_cast<int64_t>(bucket_index));
    return;
  }
  if (has_reduce_scatter_) {
    bucket.result = bucket.shard;
    bucket.shard = at::Tensor();  // still held, now as the result
  } else if (scatter_) {
    bucket.result = copy_slice ? reduced.clone() : reduced;
    if (copy_slice) hold(bucket.result);
  } else {
    bucket.result = buffer;
    return;  // the whole buffer is the result
  }
  release(buffer);
}

void GradientReducer::accumulate_into(std::vector<at::Tensor> destinations, double scale) {
  TORCH_CHECK(destinations.size() == buckets_.size(),
              "GradientReducer.accumulate_into: ", buckets_.size(), " buckets but ",
              destinations.size(), " destinations");
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const int64_t size = buffers_.bucket_size(static_cast<int64_t>(b));
    buffers_.check_destination(static_cast<int64_t>(b), destinations[b],
                               scatter_ ? size / world_size_ : size);
  }
  destinations_ = std::move(destinations);
  scale_ = scale;
}

void GradientReducer::launch(size_t bucket_index) {
  Bucket& bucket = buckets_[bucket_index];
  at::Tensor& buffer = buffers_.buffer(static_cast<int64_t>(bucket_index));
  if (has_reduce_scatter_) {
    // Same options as the buffer: float32 on the reducer's device.
    bucket.shard = at::empty({buffer.numel() / world_size_}, buffer.options());
    hold(bucket.shard);
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    TORCH_INTERNAL_ASSERT(buffer.device() == buffers_.device() &&
                          bucket.shard.device() == buffers_.device());
    bucket.work = group_->_reduce_scatter_base(bucket.shard, buffer, options);
  } else {
    std::vector<at::Tensor> tensors{buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    TORCH_INTERNAL_ASSERT(buffer.device() == buffers_.device());
    bucket.work = group_->allreduce(tensors, options);
  }
}

std::vector<at::Tensor> GradientReducer::finish() {
  // Parameters that got no gradient (unused in this step on this rank) contribute zeros.
  // Their buffers are zero-filled on the reducer's device, like any other.
  for (size_t b = next_to_launch_; b < buckets_.size(); ++b) {
    const auto bucket = static_cast<int64_t>(b);
    if (buffers_.fill_missing(bucket)) hold(buffers_.buffer(bucket));
  }
  launch_complete_buckets_in_order();

  for (; next_to_harvest_ < buckets_.size(); ++next_to_harvest_)
    harvest(next_to_harvest_, /*copy_slice=*/false);

  std::vector<at::Tensor> results;
  results.reserve(buckets_.size());
  for (Bucket& bucket : buckets_) {
    results.push_back(bucket.result);
    bucket.result = at::Tensor();
  }
  buffers_.reset();
  held_bytes_ = 0;  // every buffer and result now belongs to the caller
  next_to_launch_ = 0;
  next_to_harvest_ = 0;
  received_ = 0;
  overwrite_ = false;
  return results;
}

}  // namespace deepspeed_cpp
