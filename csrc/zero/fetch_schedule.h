// Torch-free core of ZeRO stage 3's fetch scheduler: decides which fetch units to gather and when
// to release them. The Python coordinator executes the decisions (collectives, waits, frees).
//
// Every decision is a deterministic function of the sequence of calls, so ranks that run the same
// modules issue the same collectives in the same order; nothing here depends on timing, addresses
// or hash-table iteration order.
#pragma once

#include <cstdint>
#include <vector>

namespace deepspeed_cpp {

class FetchSchedule {
 public:
  // unit_numel[u]: element count of fetch unit u (>= 0). Budgets are in elements (>= 0):
  //  - prefetch_bucket_size: most elements gathered ahead of their use, or one unit larger than
  //    that (0: gather on demand only);
  //  - max_live_parameters: prefetch never takes the gathered total above this (a demanded unit
  //    is still gathered beyond it: progress over budget);
  //  - max_reuse_distance: on_done keeps a unit whose next use is at most this many elements away
  //    (and only while the gathered total is within max_live_parameters).
  // Throws std::invalid_argument naming the bad value.
  FetchSchedule(std::vector<int64_t> unit_numel, int64_t prefetch_bucket_size,
                int64_t max_live_parameters, int64_t max_reuse_distance);

  // The caller is about to run code needing `unit`: returns the units to gather now, in order
  // (the demanded unit first if it was released, then prefetches).
  std::vector<int64_t> on_use(int64_t unit);
  // The caller is done with `unit` for now: true means release it now.
  bool on_done(int64_t unit);
  // Ends the pass: returns the still-gathered units (ascending id), all now released.
  std::vector<int64_t> end_pass();
  // Forgets the trace; the next pass records. Mid-pass, the rest of the pass runs on demand.
  void invalidate();

  bool recording() const { return !replay_ready_; }
  bool diverged() const { return diverged_; }
  int64_t divergences() const { return divergences_; }
  int64_t live_numel() const { return live_numel_; }
  int64_t peak_live_numel() const { return peak_live_numel_; }
  void reset_peak() { peak_live_numel_ = live_numel_; }
  std::vector<int64_t> trace() const { return trace_; }
  int64_t num_units() const { return static_cast<int64_t>(numel_.size()); }

 private:
  void check_unit(int64_t unit, const char* method) const;
  void gather(int64_t unit, std::vector<int64_t>& out);
  void release(int64_t unit);
  void prefetch(std::vector<int64_t>& out);
  // Replays a fresh trace: per-unit positions and prefix sums make on_done's look-up O(log n).
  void adopt_trace(std::vector<int64_t> trace);

  std::vector<int64_t> numel_;
  int64_t prefetch_bucket_size_;
  int64_t max_live_parameters_;
  int64_t max_reuse_distance_;

  std::vector<char> gathered_;  // char, not vector<bool>: plain per-element stores
  std::vector<char> ahead_;     // prefetched and not yet used
  int64_t live_numel_ = 0;
  int64_t ahead_numel_ = 0;
  int64_t peak_live_numel_ = 0;

  bool replay_ready_ = false;  // trace_ is a complete pass to replay
  std::vector<int64_t> trace_;
  std::vector<std::vector<int64_t>> positions_;  // positions_[u]: indices of u in trace_, sorted
  std::vector<int64_t> prefix_numel_;            // prefix_numel_[i]: numel of trace_[0, i)
  std::vector<int64_t> recorded_;                // the trace this pass records
  int64_t position_ = 0;                         // next expected trace entry while replaying
  bool in_pass_ = false;                         // on_use was called since the last end_pass
  bool diverged_ = false;
  int64_t divergences_ = 0;
};

}  // namespace deepspeed_cpp
