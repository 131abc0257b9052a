#include "reducer_buffers.h"

#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>

namespace deepspeed_cpp {

ReducerBuffers::ReducerBuffers(std::vector<int64_t> param_bucket, std::vector<int64_t> param_offset,
                               std::vector<int64_t> param_numel, std::vector<int64_t> bucket_sizes,
                               c10::Device device)
    : device_(device),
      param_bucket_(std::move(param_bucket)),
      param_offset_(std::move(param_offset)),
      param_numel_(std::move(param_numel)),
      param_shard_(param_bucket_.size(), 0),
      param_arrived_(param_bucket_.size(), 0),
      buckets_(bucket_sizes.size()) {
  const size_t num_params = param_bucket_.size();
  TORCH_CHECK(param_offset_.size() == num_params && param_numel_.size() == num_params,
              "GradientReducer: param_bucket, param_offset and param_numel must have equal "
              "lengths, got ",
              num_params, ", ", param_offset_.size(), ", ", param_numel_.size());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    TORCH_CHECK(bucket_sizes[b] > 0, "GradientReducer: bucket ", b, " has size ", bucket_sizes[b],
                "; expected a positive size");
    buckets_[b].size = bucket_sizes[b];
  }
  for (size_t p = 0; p < num_params; ++p) {
    const int64_t b = param_bucket_[p];
    TORCH_CHECK(b >= 0 && b < static_cast<int64_t>(buckets_.size()), "GradientReducer: param ", p,
                " is planned into bucket ", b, " but there are ", buckets_.size(), " buckets");
    Bucket& bucket = buckets_[b];
    const int64_t end = param_offset_[p] + param_numel_[p];
    TORCH_CHECK(param_offset_[p] >= 0 && param_numel_[p] >= 0 && end <= bucket.size,
                "GradientReducer: param ", p, " spans [", param_offset_[p], ", ", end,
                ") outside bucket ", b, " of size ", bucket.size);
    bucket.members.push_back(static_cast<int64_t>(p));
    bucket.used = std::max(bucket.used, end);
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    TORCH_CHECK(!buckets_[b].members.empty(), "GradientReducer: bucket ", b, " has no parameter");
  }
}

c10::Device ReducerBuffers::parse_device(const std::string& device) {
  c10::Device parsed(c10::kCPU);
  try {
    parsed = c10::Device(device);
  } catch (const c10::Error& error) {
    TORCH_CHECK(false, "GradientReducer: cannot parse device '", device,
                "': ", error.what_without_backtrace());
  }
  // CPU tensors report "cpu" with no index, so "cpu:0" would never match one.
  if (parsed.is_cpu()) return c10::Device(c10::kCPU);
  // Only here, for a bare accelerator type, is the accelerator itself asked anything.
  if (!parsed.has_index() && c10::impl::hasDeviceGuardImpl(parsed.type())) {
    const c10::Device current = c10::impl::getDeviceGuardImpl(parsed.type())->getDevice();
    if (current.has_index()) return current;
  }
  return parsed;
}

void ReducerBuffers::set_rank_major(const std::vector<int64_t>& param_shard_numel,
                                    int64_t world_size) {
  TORCH_CHECK(static_cast<int64_t>(param_shard_numel.size()) == num_params(),
              "GradientReducer.lay_out_rank_major: ", param_shard_numel.size(), " shard sizes for ",
              num_params(), " params");
  TORCH_CHECK(world_size > 0, "GradientReducer.lay_out_rank_major: world size ", world_size);
  for (const Bucket& bucket : buckets_) {
    TORCH_CHECK(!bucket.buffer.defined(),
                "GradientReducer.lay_out_rank_major: called after gradients were handed over");
  }
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    const bool rank_major = param_shard_numel[bucket.members.front()] > 0;
    for (int64_t p : bucket.members)
      TORCH_CHECK((param_shard_numel[p] > 0) == rank_major,
                  "GradientReducer.lay_out_rank_major: bucket ", b,
                  " mixes rank-major and contiguous params (param ", p, ")");
    if (!rank_major) continue;
    TORCH_CHECK(bucket.size % world_size == 0, "GradientReducer.lay_out_rank_major: bucket ", b,
                " has size ", bucket.size, ", not a multiple of the world size ", world_size);
    const int64_t shard = bucket.size / world_size;
    // Members sorted by offset must tile [0, shard) with no gap or overlap: then every element
    // of the buffer is written by exactly one member and no padding is left to zero.
    std::vector<int64_t> members = bucket.members;
    std::sort(members.begin(), members.end(),
              [this](int64_t a, int64_t c) { return param_offset_[a] < param_offset_[c]; });
    int64_t covered = 0;
    for (int64_t p : members) {
      const int64_t piece = param_shard_numel[p];
      TORCH_CHECK(param_offset_[p] == covered && param_numel_[p] <= piece * world_size,
                  "GradientReducer.lay_out_rank_major: param ", p, " of bucket ", b, " (offset ",
                  param_offset_[p], ", ", param_numel_[p], " elements, ", piece,
                  " per rank) does not continue its bucket's shard at ", covered);
      covered += piece;
    }
    TORCH_CHECK(covered == shard, "GradientReducer.lay_out_rank_major: the params of bucket ", b,
                " cover ", covered, " of its shard's ", shard, " elements");
    bucket.used = bucket.size;
  }
  param_shard_ = param_shard_numel;
  world_size_ = world_size;
}

at::Tensor ReducerBuffers::slot(int64_t param, const at::Tensor& buffer) const {
  const int64_t piece = param_shard_[param];
  if (piece == 0) return buffer.narrow(0, param_offset_[param], param_numel_[param]);
  return buffer.view({world_size_, -1}).narrow(1, param_offset_[param], piece);
}

bool ReducerBuffers::ensure_buffer(Bucket& bucket) {
  if (bucket.buffer.defined()) return false;
  // Parameters overwrite their own slices; only the padding needs zeros (the collective sums it
  // and a shard may end in it).
  bucket.whole = take_spare(bucket.size);
  if (!bucket.whole.defined())
    bucket.whole = at::empty({bucket.size}, at::TensorOptions().dtype(at::kFloat).device(device_));
  bucket.buffer = bucket.whole.narrow(0, 0, bucket.size);
  if (bucket.used < bucket.size)
    bucket.buffer.narrow(0, bucket.used, bucket.size - bucket.used).zero_();
  return true;
}

bool ReducerBuffers::add_grad(int64_t param, const at::Tensor& grad) {
  TORCH_CHECK(param >= 0 && param < num_params(), "GradientReducer.add_grad: param index ", param,
              " is out of range [0, ", num_params(), ")");
  TORCH_CHECK(!param_arrived_[param], "GradientReducer.add_grad: the gradient of param ", param,
              " was already handed over in this step");
  TORCH_CHECK(grad.numel() == param_numel_[param], "GradientReducer.add_grad: param ", param,
              " has ", param_numel_[param], " elements but its gradient has ", grad.numel(),
              " (shape ", grad.sizes(), ")");
  TORCH_CHECK(grad.device() == device_, "GradientReducer.add_grad: the gradient of param ", param,
              " is on ", grad.device(), " but the reducer's buffers are on ", device_,
              " (the device it was built for)");
  Bucket& bucket = buckets_[param_bucket_[param]];
  const bool allocated = ensure_buffer(bucket);
  at::Tensor destination = slot(param, bucket.buffer);
  const at::Tensor flat = grad.reshape({-1});
  if (param_shard_[param] == 0) {
    destination.copy_(flat);
  } else {
    // Whole rows first, then the row the gradient ends in, then zeros for the padding.
    const int64_t piece = param_shard_[param];
    const int64_t rows = param_numel_[param] / piece;
    const int64_t rest = param_numel_[param] - rows * piece;
    if (rows > 0)
      destination.narrow(0, 0, rows).copy_(flat.narrow(0, 0, rows * piece).view({rows, piece}));
    if (rest > 0) {
      at::Tensor row = destination.select(0, rows);
      row.narrow(0, 0, rest).copy_(flat.narrow(0, rows * piece, rest));
      row.narrow(0, rest, piece - rest).zero_();
    }
    const int64_t filled = rows + (rest > 0 ? 1 : 0);
    if (filled < world_size_) destination.narrow(0, filled, world_size_ - filled).zero_();
  }
  param_arrived_[param] = 1;
  ++bucket.arrived;
  return allocated;
}

bool ReducerBuffers::fill_missing(int64_t bucket_index) {
  Bucket& bucket = buckets_[bucket_index];
  if (bucket.arrived == 0 && !bucket.buffer.defined()) {
    // Nothing arrived: one zero fill of the whole buffer instead of padding plus every member
    // (a spare, like any other bucket's, where one fits).
    ensure_buffer(bucket);
    bucket.buffer.zero_();
    for (int64_t p : bucket.members) param_arrived_[p] = 1;
    bucket.arrived = static_cast<int64_t>(bucket.members.size());
    return true;
  }
  const bool allocated = ensure_buffer(bucket);
  for (int64_t p : bucket.members) {
    if (param_arrived_[p]) continue;
    if (param_shard_[p] == 0) {
      bucket.buffer.narrow(0, param_offset_[p], param_numel_[p]).zero_();
    } else {
      slot(p, bucket.buffer).zero_();
    }
    param_arrived_[p] = 1;
    ++bucket.arrived;
  }
  return allocated;
}

void ReducerBuffers::check_destination(int64_t bucket, const at::Tensor& destination,
                                       int64_t numel) const {
  TORCH_CHECK(destination.scalar_type() == at::kFloat && destination.dim() == 1 &&
                  destination.numel() == numel && destination.is_contiguous(),
              "GradientReducer.accumulate_into: destination ", bucket,
              " must be a contiguous 1-D float32 tensor of ", numel, " elements, got dtype ",
              destination.scalar_type(), " and shape ", destination.sizes());
  TORCH_CHECK(destination.device() == device_, "GradientReducer.accumulate_into: destination ",
              bucket, " is on ", destination.device(), " but the reducer's buffers are on ",
              device_, "; reduced buckets are not copied between devices");
}

at::Tensor ReducerBuffers::take_spare(int64_t numel) {
  // Largest first: the last one that fits is the smallest that does.
  for (size_t i = spare_.size(); i-- > 0;) {
    if (spare_[i].numel() < numel) continue;
    at::Tensor spare = std::move(spare_[i]);
    spare_.erase(spare_.begin() + static_cast<std::ptrdiff_t>(i));
    return spare;
  }
  return at::Tensor();
}

void ReducerBuffers::recycle(int64_t bucket_index) {
  Bucket& bucket = buckets_[bucket_index];
  at::Tensor whole = std::move(bucket.whole);
  bucket.whole = at::Tensor();
  bucket.buffer = at::Tensor();
  if (!whole.defined()) return;
  spare_.push_back(std::move(whole));
  std::stable_sort(spare_.begin(), spare_.end(),
                   [](const at::Tensor& a, const at::Tensor& b) { return a.numel() > b.numel(); });
  if (spare_.size() > kMaxSpareBuffers) spare_.resize(kMaxSpareBuffers);
}

int64_t ReducerBuffers::spare_bytes() const {
  int64_t bytes = 0;
  for (const at::Tensor& spare : spare_) bytes += static_cast<int64_t>(spare.nbytes());
  return bytes;
}

void ReducerBuffers::reset() {
  for (Bucket& bucket : buckets_) {
    bucket.buffer = at::Tensor();
    bucket.whole = at::Tensor();
    bucket.arrived = 0;
  }
  std::fill(param_arrived_.begin(), param_arrived_.end(), 0);
}

}  // namespace deepspeed_cpp
