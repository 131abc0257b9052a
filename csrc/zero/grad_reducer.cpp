#include "grad_reducer.h"

#include <algorithm>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

namespace deepspeed_cpp {

GradientReducer::GradientReducer(const std::string& group_name, std::vector<int64_t> param_bucket,
                                 std::vector<int64_t> param_offset,
                                 std::vector<int64_t> param_numel,
                                 std::vector<int64_t> bucket_sizes, bool scatter,
                                 const std::string& scatter_method, const std::string& device)
    : group_(c10d::resolve_process_group(group_name)),
      rank_(group_->getRank()),
      world_size_(group_->getSize()),
      scatter_(scatter),
      param_bucket_(std::move(param_bucket)),
      param_offset_(std::move(param_offset)),
      param_numel_(std::move(param_numel)),
      param_arrived_(param_bucket_.size(), 0),
      buckets_(bucket_sizes.size()) {
  const size_t num_params = param_bucket_.size();
  TORCH_CHECK(param_offset_.size() == num_params && param_numel_.size() == num_params,
              "GradientReducer: param_bucket, param_offset and param_numel must have equal "
              "lengths, got ",
              num_params, ", ", param_offset_.size(), ", ", param_numel_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    // Only a scattered bucket splits into one shard per rank.
    TORCH_CHECK(bucket_sizes[b] > 0 && (!scatter_ || bucket_sizes[b] % world_size_ == 0),
                "GradientReducer: bucket ", b, " has size ", bucket_sizes[b],
                "; expected a positive multiple of the world size ", world_size_);
    buckets_[b].size = bucket_sizes[b];
  }
  for (size_t p = 0; p < num_params; ++p) {
    const int64_t b = param_bucket_[p];
    TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(buckets_.size()), "GradientReducer: param ", p,
                " is planned into bucket ", b, " but there are ", buckets_.size(), " buckets");
    Bucket& bucket = buckets_[b];
    const int64_t end = param_offset_[p] + param_numel_[p];
    TORCH_CHECK(param_offset_[p] >= 0 && end <= bucket.size, "GradientReducer: param ", p,
                " spans [", param_offset_[p], ", ", end, ") outside bucket ", b, " of size ",
                bucket.size);
    bucket.members.push_back(static_cast<int64_t>(p));
    bucket.used = std::max(bucket.used, end);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    TORCH_CHECK(!buckets_[b].members.empty(), "GradientReducer: bucket ", b, " has no parameter");
  }
  has_reduce_scatter_ = scatter_ && choose_reduce_scatter(scatter_method, c10::Device(device));
}

bool GradientReducer::choose_reduce_scatter(const std::string& scatter_method,
                                            const c10::Device& device) {
  if (scatter_method == "all_reduce") return false;
  if (scatter_method == "reduce_scatter") {
    TORCH_CHECK(probe_reduce_scatter(device),
                "GradientReducer: scatter_method 'reduce_scatter' "
                "was asked for, but the process group's ",
                group_->getBackendName(), " backend has no reduce-scatter on ", device);
    return true;
  }
  TORCH_CHECK(scatter_method == "auto", "GradientReducer: scatter_method must be 'auto', ",
              "'reduce_scatter' or 'all_reduce', got '", scatter_method, "'");
  if (group_->getBackend(device.type())->getBackendName() == "gloo") return false;
  return probe_reduce_scatter(device);
}

bool GradientReducer::probe_reduce_scatter(const c10::Device& device) {
  // Every rank builds its reducer at the same point, so the probe is a collective like any
  // other. A backend without the op throws before communicating.
  try {
    const auto options_on_device = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor input = at::ones({world_size_}, options_on_device);
    at::Tensor output = at::empty({1}, options_on_device);
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

void GradientReducer::ensure_buffer(Bucket& bucket) {
  if (bucket.buffer.defined()) return;
  bucket.buffer = at::empty({bucket.size}, at::kFloat);
  hold(bucket.buffer);
  if (bucket.used < bucket.size)
    bucket.buffer.narrow(0, bucket.used, bucket.size - bucket.used).zero_();
}

void GradientReducer::add_grad(int64_t param, const at::Tensor& grad) {
  TORCH_CHECK(param >= 0 && param < static_cast<int64_t>(param_bucket_.size()),
              "GradientReducer.add_grad: param index ", param, " is out of range [0, ",
              param_bucket_.size(), ")");
  TORCH_CHECK(!param_arrived_[param], "GradientReducer.add_grad: the gradient of param ", param,
              " was already handed over in this step");
  TORCH_CHECK(grad.numel() == param_numel_[param], "GradientReducer.add_grad: param ", param,
              " has ", param_numel_[param], " elements but its gradient has ", grad.numel(),
              " (shape ", grad.sizes(), ")");
  TORCH_CHECK(grad.device().is_cpu() || grad.device().is_cuda(),
              "GradientReducer.add_grad: unsupported gradient device ", grad.device());
  Bucket& bucket = buckets_[param_bucket_[param]];
  ensure_buffer(bucket);
  if (bucket.buffer.device() != grad.device()) bucket.buffer = bucket.buffer.to(grad.device());
  bucket.buffer.narrow(0, param_offset_[param], param_numel_[param]).copy_(grad.reshape({-1}));
  param_arrived_[param] = 1;
  ++bucket.arrived;
  ++received_;
  launch_complete_buckets_in_order();
}

void GradientReducer::launch_complete_buckets_in_order() {
  while (next_to_launch_ < buckets_.size()) {
    Bucket& bucket = buckets_[next_to_launch_];
    if (bucket.arrived < static_cast<int64_t>(bucket.members.size())) return;
    launch(bucket);
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
  bucket.work->wait();
  bucket.work.reset();
  at::Tensor reduced;
  if (has_reduce_scatter_) {
    reduced = bucket.shard;
  } else if (scatter_) {
    const int64_t shard = bucket.size / world_size_;
    reduced = bucket.buffer.narrow(0, rank_ * shard, shard);
  } else {
    reduced = bucket.buffer;
  }
  if (!destinations_.empty()) {
    at::Tensor& destination = destinations_[bucket_index];
    if (reduced.device() != destination.device()) reduced = reduced.to(destination.device());
    // Overwriting gives what adding to zeros would: scale * reduced, rounded once.
    if (overwrite_) {
      at::mul_out(destination, reduced, scale_);
    } else {
      destination.add_(reduced, scale_);
    }
    bucket.result = destination;
    release(bucket.shard);
    release(bucket.buffer);
    return;
  }
  if (has_reduce_scatter_) {
    bucket.result = bucket.shard;
    bucket.shard = at::Tensor();  // still held, now as the result
  } else if (scatter_) {
    bucket.result = copy_slice ? reduced.clone() : reduced;
    if (copy_slice) hold(bucket.result);
  } else {
    bucket.result = bucket.buffer;
    return;  // the whole buffer is the result
  }
  release(bucket.buffer);
}

void GradientReducer::accumulate_into(std::vector<at::Tensor> destinations, double scale) {
  TORCH_CHECK(destinations.size() == buckets_.size(),
              "GradientReducer.accumulate_into: ", buckets_.size(), " buckets but ",
              destinations.size(), " destinations");
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const int64_t expected = scatter_ ? buckets_[b].size / world_size_ : buckets_[b].size;
    const at::Tensor& destination = destinations[b];
    TORCH_CHECK(destination.scalar_type() == at::kFloat && destination.dim() == 1 &&
                    destination.numel() == expected && destination.is_contiguous(),
                "GradientReducer.accumulate_into: destination ", b,
                " must be a contiguous 1-D float32 tensor of ", expected, " elements, got dtype ",
                destination.scalar_type(), " and shape ", destination.sizes());
  }
  destinations_ = std::move(destinations);
  scale_ = scale;
}

void GradientReducer::launch(Bucket& bucket) {
  if (has_reduce_scatter_) {
    bucket.shard = at::empty({bucket.size / world_size_}, bucket.buffer.options());
    hold(bucket.shard);
    c10d::ReduceScatterOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    bucket.work = group_->_reduce_scatter_base(bucket.shard, bucket.buffer, options);
  } else {
    std::vector<at::Tensor> tensors{bucket.buffer};
    c10d::AllreduceOptions options;
    options.reduceOp = c10d::ReduceOp::SUM;
    bucket.work = group_->allreduce(tensors, options);
  }
}

std::vector<at::Tensor> GradientReducer::finish() {
  // Parameters that got no gradient (unused in this step on this rank) contribute zeros.
  for (size_t b = next_to_launch_; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    ensure_buffer(bucket);
    for (int64_t p : bucket.members) {
      if (param_arrived_[p]) continue;
      bucket.buffer.narrow(0, param_offset_[p], param_numel_[p]).zero_();
      param_arrived_[p] = 1;
      ++bucket.arrived;
    }
  }
  launch_complete_buckets_in_order();

  for (; next_to_harvest_ < buckets_.size(); ++next_to_harvest_)
    harvest(next_to_harvest_, /*copy_slice=*/false);

  std::vector<at::Tensor> results;
  results.reserve(buckets_.size());
  for (Bucket& bucket : buckets_) {
    results.push_back(bucket.result);
    bucket.result = at::Tensor();
    bucket.buffer = at::Tensor();
    bucket.arrived = 0;
  }
  held_bytes_ = 0;  // every buffer and result now belongs to the caller
  std::fill(param_arrived_.begin(), param_arrived_.end(), 0);
  next_to_launch_ = 0;
  next_to_harvest_ = 0;
  received_ = 0;
  overwrite_ = false;
  return results;
}

}  // namespace deepspeed_cpp
