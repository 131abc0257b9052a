// One worker thread of a handle: cuts its share of each request into pieces and keeps up to
// queue_depth of them in flight on its own engine.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "file_request.h"
#include "io_engine.h"

namespace deepspeed_cpp {
namespace aio {

// A contiguous part [cursor, end) of one request given to one worker. Slices of a request meet
// at block boundaries of its aligned body, so every piece a worker cuts is a whole block, the
// unaligned head (first slice) or the unaligned tail (last slice).
struct WorkSlice {
  std::shared_ptr<FileRequest> request;
  int64_t cursor;  // next byte to hand out
  int64_t end;
  int in_flight = 0;           // pieces of this slice in the engine
  bool generated_all = false;  // no more pieces will be cut (done, or the request failed)
};

// What a worker tells its handle. Called from the worker's thread.
class WorkerObserver {
 public:
  virtual ~WorkerObserver() = default;
  // Every slice of `request` is finished: nothing of it is in flight any more.
  virtual void request_finished(FileRequest& request) = 0;
  virtual void count_transfer(bool direct, bool bounced, int64_t bytes) = 0;
  // A direct transfer was refused with EINVAL and the request continues buffered.
  virtual void direct_io_refused(const FileRequest& request, const std::string& why) = 0;
};

struct WorkerSettings {
  int64_t block_size;
  int queue_depth;
  bool single_submit;   // hand each piece to the kernel as soon as it is prepared
  bool overlap_events;  // refill the queue on every completion (else: whole batches)
};

class IoWorker {
 public:
  IoWorker(const WorkerSettings& settings, std::unique_ptr<IoEngine> engine,
           WorkerObserver& observer);
  // Joins the thread. The owner waits for every request to finish first.
  ~IoWorker();
  IoWorker(const IoWorker&) = delete;
  IoWorker& operator=(const IoWorker&) = delete;

  void post(std::shared_ptr<WorkSlice> slice);

 private:
  void run();
  void fill_queue();
  bool start_piece();
  void choose_descriptor(IoPiece& piece) const;
  void handle(const Completion& completion);
  void finish_piece(IoPiece& piece);
  void finish_slice(WorkSlice& slice);
  std::string describe_transfer(const IoPiece& piece) const;
  char* bounce_buffer(int slot);

  const WorkerSettings settings_;
  const std::unique_ptr<IoEngine> engine_;
  WorkerObserver& observer_;

  // Worker-thread state.
  std::vector<IoPiece> pieces_;  // queue_depth slots
  std::vector<int> free_slots_;
  std::vector<char*> bounce_buffers_;  // per slot, allocated on first need
  int in_flight_ = 0;
  std::deque<std::shared_ptr<WorkSlice>> generating_;

  // Shared with posting threads.
  std::mutex mutex_;
  std::condition_variable posted_;
  std::deque<std::shared_ptr<WorkSlice>> inbox_;
  bool stopping_ = false;

  std::thread thread_;  // last: started once everything it uses exists
};

}  // namespace aio
}  // namespace deepspeed_cpp
