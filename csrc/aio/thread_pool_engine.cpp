// The always-available engine: `queue_depth` threads (at most kMaxThreads), each doing one
// blocking pread/pwrite at a time, so that as many requests wait on the device together as with a
// kernel queue of that depth.
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io_engine.h"

namespace deepspeed_cpp {
namespace aio {
namespace {

// Deeper queues than this gain nothing from more threads; the extra pieces wait in work_.
constexpr int kMaxThreads = 128;

class ThreadPoolEngine final : public IoEngine {
 public:
  explicit ThreadPoolEngine(int queue_depth) {
    const int count = queue_depth < kMaxThreads ? queue_depth : kMaxThreads;
    threads_.reserve(count);
    for (int i = 0; i < count; ++i) threads_.emplace_back([this] { serve(); });
  }

  ~ThreadPoolEngine() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (std::thread& thread : threads_) thread.join();
  }

  EngineKind kind() const override { return EngineKind::kThreads; }

  void enqueue(IoPiece* piece) override { staged_.push_back(piece); }

  void submit() override {
    if (staged_.empty()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (IoPiece* piece : staged_) work_.push_back(piece);
    }
    staged_.clear();
    work_ready_.notify_all();
  }

  void reap(std::vector<Completion>& out, bool block) override {
    std::unique_lock<std::mutex> lock(mutex_);
    if (block) done_ready_.wait(lock, [this] { return !done_.empty(); });
    out.insert(out.end(), done_.begin(), done_.end());
    done_.clear();
  }

 private:
  void serve() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (true) {
      work_ready_.wait(lock, [this] { return stopping_ || !work_.empty(); });
      if (work_.empty()) return;  // stopping with nothing left
      IoPiece* piece = work_.front();
      work_.pop_front();
      lock.unlock();
      const int64_t result = transfer(*piece);
      lock.lock();
      done_.push_back(Completion{piece, result});
      done_ready_.notify_one();
    }
  }

  static int64_t transfer(const IoPiece& piece) {
    const ssize_t moved =
        piece.is_read
            ? pread(piece.fd, piece.cursor_buffer(), piece.remaining(), piece.cursor_offset())
            : pwrite(piece.fd, piece.cursor_buffer(), piece.remaining(), piece.cursor_offset());
    return moved < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(moved);
  }

  std::vector<IoPiece*> staged_;  // owner thread only
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable done_ready_;
  std::deque<IoPiece*> work_;
  std::vector<Completion> done_;
  bool stopping_ = false;
  std::vector<std::thread> threads_;  // last: started after everything they use exists
};

}  // namespace

std::unique_ptr<IoEngine> make_thread_pool_engine(int queue_depth) {
  return std::make_unique<ThreadPoolEngine>(queue_depth);
}

}  // namespace aio
}  // namespace deepspeed_cpp
