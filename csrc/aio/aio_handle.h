// The torch-free asynchronous I/O handle: requests in, one wait() out, every failure reported.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "file_request.h"
#include "io_engine.h"
#include "io_worker.h"

namespace deepspeed_cpp {
namespace aio {

struct HandleConfig {
  int64_t block_size;
  int64_t queue_depth;
  bool single_submit;
  bool overlap_events;
  int64_t intra_op_parallelism;
  EngineKind engine;  // kAuto resolves at construction
};

// Bytes moved since the handle was made, by path.
struct TransferStats {
  int64_t direct_bytes;    // through O_DIRECT
  int64_t buffered_bytes;  // through the page cache (unaligned head/tail, file systems without
                           // O_DIRECT)
  int64_t bounced_bytes;   // through an aligned bounce buffer (a subset of direct_bytes)
};

// Submission and wait() are meant for one thread at a time (the handle's owner); the workers
// run on their own threads.
class AioHandle final : public WorkerObserver {
 public:
  // Throws std::invalid_argument naming a bad setting, std::runtime_error when the engine cannot
  // start.
  explicit AioHandle(const HandleConfig& config);
  // Waits for everything in flight (dropping its errors) and stops the workers.
  ~AioHandle() override;

  // Starts reading (or writing) `bytes` bytes at `buffer` from (to) `path` at `file_offset`
  // and returns at once. The memory must stay valid until wait() returns. Failures, including
  // the ones of opening the file, are reported by wait(). See RequestSpec for `truncate`.
  void submit(IoDirection direction, char* buffer, int64_t bytes, const std::string& path,
              int64_t file_offset, bool truncate = true);
  // Blocks until every submitted request finished; returns how many there were. Throws
  // std::runtime_error listing each failed request (what, which file, where, the OS error);
  // the handle is ready for new requests either way.
  int64_t wait();
  // Requests submitted since the last wait().
  int64_t pending() const;

  const HandleConfig& config() const { return config_; }
  EngineKind engine() const { return engine_; }
  TransferStats stats() const;
  // The message about the first request that had to run without O_DIRECT, once; then "".
  std::string take_buffered_fallback_notice();

  // WorkerObserver
  void request_finished(FileRequest& request) override;
  void count_transfer(bool direct, bool bounced, int64_t bytes) override;
  void direct_io_refused(const FileRequest& request, const std::string& why) override;

 private:
  void post_slices(const std::shared_ptr<FileRequest>& request);
  void note_buffered_fallback(const FileRequest& request, const std::string& why);

  HandleConfig config_;
  EngineKind engine_;

  mutable std::mutex mutex_;
  std::condition_variable finished_changed_;
  std::vector<std::shared_ptr<FileRequest>> requests_;  // since the last wait()
  int64_t finished_ = 0;
  std::string fallback_notice_;
  bool fallback_noticed_ = false;

  std::atomic<int64_t> direct_bytes_{0};
  std::atomic<int64_t> buffered_bytes_{0};
  std::atomic<int64_t> bounced_bytes_{0};

  size_t next_worker_ = 0;
  std::vector<std::unique_ptr<IoWorker>> workers_;  // last: stopped first
};

}  // namespace aio
}  // namespace deepspeed_cpp
