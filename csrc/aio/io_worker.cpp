#include "io_worker.h"

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "locked_memory.h"
#include "os_error.h"

namespace deepspeed_cpp {
namespace aio {
namespace {

// EINTR/EAGAIN are retried; a remainder that keeps getting them this often is reported instead.
constexpr int kMaxRetries = 1000;

bool is_aligned(int64_t value) { return value % kDirectIoAlignment == 0; }
bool is_aligned(const char* address) {
  return reinterpret_cast<std::uintptr_t>(address) % kDirectIoAlignment == 0;
}

}  // namespace

IoWorker::IoWorker(const WorkerSettings& settings, std::unique_ptr<IoEngine> engine,
                   WorkerObserver& observer)
    : settings_(settings),
      engine_(std::move(engine)),
      observer_(observer),
      pieces_(settings.queue_depth),
      bounce_buffers_(settings.queue_depth, nullptr) {
  for (int slot = settings.queue_depth - 1; slot >= 0; --slot) {
    pieces_[slot].slot = slot;
    free_slots_.push_back(slot);
  }
  // An exception escaping run() (a broken io_uring or AIO context, with pieces in flight that
  // can no longer be accounted for) terminates the process with its message: better than
  // reporting success for data that may never have moved.
  thread_ = std::thread([this] { run(); });
}

IoWorker::~IoWorker() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  posted_.notify_one();
  thread_.join();
  for (char* buffer : bounce_buffers_) {
    free_locked(buffer, static_cast<std::size_t>(settings_.block_size));
  }
}

void IoWorker::post(std::shared_ptr<WorkSlice> slice) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    inbox_.push_back(std::move(slice));
  }
  posted_.notify_one();
}

void IoWorker::run() {
  std::vector<Completion> completions;
  while (true) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      if (generating_.empty() && in_flight_ == 0) {
        posted_.wait(lock, [this] { return stopping_ || !inbox_.empty(); });
        if (inbox_.empty()) return;  // stopping, and everything is done
      }
      for (auto& slice : inbox_) generating_.push_back(std::move(slice));
      inbox_.clear();
    }
    // Without overlap_events the queue is refilled only once the whole batch has completed.
    if (settings_.overlap_events || in_flight_ == 0) fill_queue();
    completions.clear();
    if (in_flight_ == 0) continue;
    engine_->submit_and_reap(completions);
    for (const Completion& completion : completions) handle(completion);
  }
}

void IoWorker::fill_queue() {
  while (!free_slots_.empty() && start_piece()) {
    if (settings_.single_submit) engine_->submit();
  }
}

bool IoWorker::start_piece() {
  while (!generating_.empty()) {
    WorkSlice& slice = *generating_.front();
    FileRequest& request = *slice.request;
    if (slice.cursor >= slice.end || request.failed()) {
      // Finished cutting (a failed request gets no new pieces; those in flight complete).
      std::shared_ptr<WorkSlice> done = std::move(generating_.front());
      generating_.pop_front();
      done->generated_all = true;
      if (done->in_flight == 0) finish_slice(*done);
      continue;
    }
    const int64_t start = slice.cursor;
    int64_t stop;
    if (start < request.body_begin()) {
      stop = std::min(request.body_begin(), slice.end);  // the unaligned head
    } else if (start < request.body_end()) {
      stop = std::min({start + settings_.block_size, request.body_end(), slice.end});
    } else {
      stop = slice.end;  // the unaligned tail
    }
    const int slot = free_slots_.back();
    free_slots_.pop_back();
    IoPiece& piece = pieces_[slot];
    piece.slice = generating_.front();
    piece.request = &request;
    piece.is_read = request.is_read();
    piece.file_offset = start;
    piece.length = stop - start;
    piece.done = 0;
    piece.retries = 0;
    piece.direct_refusal.clear();
    piece.user_buffer = request.user_buffer_at(start);
    // A whole block whose memory is not page-aligned goes through the slot's aligned bounce
    // buffer, so that it can still use O_DIRECT.
    piece.bounced = request.direct_allowed() && is_aligned(start) && is_aligned(piece.length) &&
                    !is_aligned(piece.user_buffer);
    piece.io_buffer = piece.bounced ? bounce_buffer(slot) : piece.user_buffer;
    if (piece.bounced && !piece.is_read) {
      std::memcpy(piece.io_buffer, piece.user_buffer, static_cast<size_t>(piece.length));
    }
    choose_descriptor(piece);
    slice.cursor = stop;
    ++slice.in_flight;
    ++in_flight_;
    engine_->enqueue(&piece);
    return true;
  }
  return false;
}

void IoWorker::choose_descriptor(IoPiece& piece) const {
  const FileRequest& request = *piece.request;
  piece.direct = request.direct_allowed() && piece.direct_refusal.empty() &&
                 is_aligned(piece.cursor_offset()) && is_aligned(piece.remaining()) &&
                 is_aligned(piece.cursor_buffer());
  piece.fd = piece.direct ? request.direct_fd() : request.buffered_fd();
}

void IoWorker::handle(const Completion& completion) {
  IoPiece& piece = *completion.piece;
  FileRequest& request = *piece.request;
  const int64_t result = completion.result;
  if ((result == -EINTR || result == -EAGAIN) && ++piece.retries <= kMaxRetries) {
    engine_->enqueue(&piece);
    return;
  }
  if (result == -EINVAL && piece.direct) {
    // Either the file system takes open(O_DIRECT) but not direct transfers, or something else
    // is wrong (e.g. a file-size limit cut the transfer to an unaligned length). The piece goes
    // on buffered: that path succeeds in the first case and reports the true error otherwise.
    piece.direct_refusal = describe_transfer(piece) + " failed with " + describe_errno(EINVAL);
    choose_descriptor(piece);
    engine_->enqueue(&piece);
    return;
  }
  if (result < 0) {
    request.fail(describe_transfer(piece) +
                 " failed: " + describe_errno(static_cast<int>(-result)));
  } else if (result == 0) {
    request.fail(describe_transfer(piece) +
                 (piece.is_read ? " reached the end of the file" : " wrote nothing"));
  } else {
    observer_.count_transfer(piece.direct, piece.bounced && piece.direct, result);
    piece.done += result;
    piece.retries = 0;
    if (piece.done < piece.length && !request.failed()) {
      // A short transfer: the rest goes on, buffered if it no longer meets O_DIRECT's alignment.
      choose_descriptor(piece);
      engine_->enqueue(&piece);
      return;
    }
    if (piece.bounced && piece.is_read && !request.failed()) {
      std::memcpy(piece.user_buffer, piece.io_buffer, static_cast<size_t>(piece.length));
    }
    if (!piece.direct_refusal.empty() && !request.failed()) {
      request.stop_direct_io();  // the file system does refuse direct transfers
      observer_.direct_io_refused(request, piece.direct_refusal);
    }
  }
  finish_piece(piece);
}

void IoWorker::finish_piece(IoPiece& piece) {
  std::shared_ptr<WorkSlice> slice = std::move(piece.slice);
  piece.request = nullptr;
  free_slots_.push_back(piece.slot);
  --in_flight_;
  if (--slice->in_flight == 0 && slice->generated_all) finish_slice(*slice);
}

void IoWorker::finish_slice(WorkSlice& slice) {
  FileRequest& request = *slice.request;
  if (request.open_slices.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    observer_.request_finished(request);
  }
}

std::string IoWorker::describe_transfer(const IoPiece& piece) const {
  return std::string("at file offset ") + std::to_string(piece.cursor_offset()) + ", the " +
         engine_name(engine_->kind()) + (piece.is_read ? " pread of " : " pwrite of ") +
         std::to_string(piece.remaining()) + " bytes" + (piece.direct ? " (O_DIRECT)" : "");
}

char* IoWorker::bounce_buffer(int slot) {
  if (bounce_buffers_[slot] == nullptr) {
    bounce_buffers_[slot] =
        static_cast<char*>(allocate_locked(static_cast<std::size_t>(settings_.block_size)));
  }
  return bounce_buffers_[slot];
}

}  // namespace aio
}  // namespace deepspeed_cpp
