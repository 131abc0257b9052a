#include "fetch_schedule.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

namespace deepspeed_cpp {
namespace {

void check_budget(int64_t value, const char* name) {
  if (value < 0) {
    throw std::invalid_argument(std::string("FetchSchedule: ") + name + " must be >= 0, got " +
                                std::to_string(value));
  }
}

}  // namespace

FetchSchedule::FetchSchedule(std::vector<int64_t> unit_numel, int64_t prefetch_bucket_size,
                             int64_t max_live_parameters, int64_t max_reuse_distance)
    : numel_(std::move(unit_numel)),
      prefetch_bucket_size_(prefetch_bucket_size),
      max_live_parameters_(max_live_parameters),
      max_reuse_distance_(max_reuse_distance) {
  for (size_t u = 0; u < numel_.size(); ++u) {
    if (numel_[u] < 0) {
      throw std::invalid_argument("FetchSchedule: unit_numel[" + std::to_string(u) +
                                  "] must be >= 0, got " + std::to_string(numel_[u]));
    }
  }
  check_budget(prefetch_bucket_size, "prefetch_bucket_size");
  check_budget(max_live_parameters, "max_live_parameters");
  check_budget(max_reuse_distance, "max_reuse_distance");
  gathered_.assign(numel_.size(), 0);
  ahead_.assign(numel_.size(), 0);
}

void FetchSchedule::check_unit(int64_t unit, const char* method) const {
  if (unit < 0 || unit >= num_units()) {
    throw std::invalid_argument(std::string("FetchSchedule.") + method + ": unit " +
                                std::to_string(unit) + " is out of range [0, " +
                                std::to_string(num_units()) + ")");
  }
}

void FetchSchedule::gather(int64_t unit, std::vector<int64_t>& out) {
  gathered_[unit] = 1;
  live_numel_ += numel_[unit];
  peak_live_numel_ = std::max(peak_live_numel_, live_numel_);
  out.push_back(unit);
}

void FetchSchedule::release(int64_t unit) {
  gathered_[unit] = 0;
  live_numel_ -= numel_[unit];
  if (ahead_[unit]) {
    ahead_[unit] = 0;
    ahead_numel_ -= numel_[unit];
  }
}

// Walks the trace from the next expected entry and gathers released units in trace order while
// both budgets hold. It stops at the first unit that does not fit instead of skipping to a
// smaller one behind it: the collectives then follow the trace order on every rank.
void FetchSchedule::prefetch(std::vector<int64_t>& out) {
  // A zero budget means "on demand": not even empty units are gathered ahead.
  if (prefetch_bucket_size_ == 0) return;
  const int64_t end = static_cast<int64_t>(trace_.size());
  for (int64_t i = position_; i < end; ++i) {
    const int64_t unit = trace_[i];
    if (gathered_[unit]) continue;  // live, in flight, or taken earlier in this walk
    const int64_t numel = numel_[unit];
    // The window always takes one unit, even one larger than the bucket (a transformer layer
    // above the bucket would otherwise never be prefetched): DeepSpeed's prefetch loop
    // overshoots its bucket by one parameter the same way. The live budget still holds.
    if ((ahead_numel_ > 0 && ahead_numel_ + numel > prefetch_bucket_size_) ||
        live_numel_ + numel > max_live_parameters_) {
      return;
    }
    ahead_[unit] = 1;
    ahead_numel_ += numel;
    gather(unit, out);
  }
}

std::vector<int64_t> FetchSchedule::on_use(int64_t unit) {
  check_unit(unit, "on_use");
  in_pass_ = true;
  std::vector<int64_t> out;
  if (!gathered_[unit]) gather(unit, out);
  if (ahead_[unit]) {  // used now, so it no longer counts against the prefetch window
    ahead_[unit] = 0;
    ahead_numel_ -= numel_[unit];
  }
  if (diverged_) return out;
  if (!replay_ready_) {
    recorded_.push_back(unit);
    return out;
  }
  if (position_ < static_cast<int64_t>(trace_.size()) && trace_[position_] == unit) {
    ++position_;
    prefetch(out);
  } else {
    // The order changed (a branch taken this step only, eval vs train): the trace no longer
    // predicts anything, so the rest of the pass is on demand and the next pass records.
    diverged_ = true;
    ++divergences_;
  }
  return out;
}

bool FetchSchedule::on_done(int64_t unit) {
  check_unit(unit, "on_done");
  if (!gathered_[unit]) {
    throw std::invalid_argument("FetchSchedule.on_done: unit " + std::to_string(unit) +
                                " is not gathered");
  }
  // Kept for a reuse only while the gathered total stays within max_live_parameters (DeepSpeed's
  // "resident before releasing"), so that a long reuse distance cannot hold the whole model.
  if (replay_ready_ && !diverged_ && live_numel_ <= max_live_parameters_) {
    // Next use at or after the next expected entry; the distance counts every trace entry
    // strictly between (repeats included), as DeepSpeed counts numel fetched in between.
    const std::vector<int64_t>& at = positions_[unit];
    const auto next = std::lower_bound(at.begin(), at.end(), position_);
    if (next != at.end() &&
        prefix_numel_[*next] - prefix_numel_[position_] <= max_reuse_distance_) {
      return false;
    }
  }
  release(unit);
  return true;
}

std::vector<int64_t> FetchSchedule::end_pass() {
  std::vector<int64_t> still;
  for (int64_t u = 0; u < num_units(); ++u) {
    if (gathered_[u]) {
      still.push_back(u);
      release(u);
    }
  }
  if (in_pass_) {
    // A replay that stopped short (eval after training: forward only) did not follow the trace.
    if (replay_ready_ && !diverged_ && position_ != static_cast<int64_t>(trace_.size())) {
      diverged_ = true;
      ++divergences_;
    }
    if (diverged_) {
      replay_ready_ = false;
      adopt_trace({});
    } else if (!replay_ready_ && !recorded_.empty()) {
      adopt_trace(std::move(recorded_));
      replay_ready_ = true;
    }
  }
  recorded_.clear();
  position_ = 0;
  in_pass_ = false;
  diverged_ = false;
  return still;
}

void FetchSchedule::invalidate() {
  replay_ready_ = false;
  adopt_trace({});
  recorded_.clear();
  // Mid-pass, what this pass would record is stale too; on demand until end_pass. Not counted
  // as a divergence: the caller asked for it.
  if (in_pass_) diverged_ = true;
}

void FetchSchedule::adopt_trace(std::vector<int64_t> trace) {
  trace_ = std::move(trace);
  positions_.assign(numel_.size(), {});
  prefix_numel_.assign(trace_.size() + 1, 0);
  for (size_t i = 0; i < trace_.size(); ++i) {
    positions_[trace_[i]].push_back(static_cast<int64_t>(i));
    prefix_numel_[i + 1] = prefix_numel_[i] + numel_[trace_[i]];
  }
}

}  // namespace deepspeed_cpp
