// The second engine: Linux native AIO through libaio, one context per worker sized to the queue
// depth. Native AIO is asynchronous only with O_DIRECT; on buffered descriptors io_submit does the
// transfer itself, which is still correct.
#include <libaio.h>

#include <cerrno>
#include <stdexcept>
#include <string>
#include <vector>

#include "io_engine.h"
#include "os_error.h"

namespace deepspeed_cpp {
namespace aio {
namespace {

class LibaioEngine final : public IoEngine {
 public:
  explicit LibaioEngine(int queue_depth) : control_blocks_(queue_depth), events_(queue_depth) {
    const int status = io_setup(queue_depth, &context_);
    if (status < 0) {
      throw std::runtime_error("io_setup(" + std::to_string(queue_depth) +
                               ") failed: " + describe_errno(-status));
    }
  }

  ~LibaioEngine() override { io_destroy(context_); }

  EngineKind kind() const override { return EngineKind::kLibaio; }

  void enqueue(IoPiece* piece) override {
    iocb* control = &control_blocks_[piece->slot];
    if (piece->is_read) {
      io_prep_pread(control, piece->fd, piece->cursor_buffer(),
                    static_cast<size_t>(piece->remaining()), piece->cursor_offset());
    } else {
      io_prep_pwrite(control, piece->fd, piece->cursor_buffer(),
                     static_cast<size_t>(piece->remaining()), piece->cursor_offset());
    }
    control->data = piece;
    staged_.push_back(control);
  }

  void submit() override {
    size_t next = 0;
    while (next < staged_.size()) {
      const int submitted =
          io_submit(context_, static_cast<long>(staged_.size() - next), staged_.data() + next);
      if (submitted > 0) {
        next += static_cast<size_t>(submitted);
      } else if (submitted == -EINTR || submitted == -EAGAIN) {
        continue;
      } else {
        // io_submit refused the first remaining request (a bad descriptor, an unsupported
        // operation, ...): that one completes with the error, the rest go on.
        const int error = submitted == 0 ? EIO : -submitted;
        refused_.push_back(Completion{static_cast<IoPiece*>(staged_[next]->data), -error});
        ++next;
      }
    }
    staged_.clear();
  }

  void reap(std::vector<Completion>& out, bool block) override {
    if (!refused_.empty()) {
      out.insert(out.end(), refused_.begin(), refused_.end());
      refused_.clear();
      block = false;
    }
    int count;
    do {
      count = io_getevents(context_, block ? 1 : 0, static_cast<long>(events_.size()),
                           events_.data(), nullptr);
    } while (count == -EINTR);
    if (count < 0) throw std::runtime_error("io_getevents failed: " + describe_errno(-count));
    for (int i = 0; i < count; ++i) {
      // res is the byte count, or a negated errno stored in an unsigned field.
      const auto result = static_cast<int64_t>(static_cast<long>(events_[i].res));
      out.push_back(Completion{static_cast<IoPiece*>(events_[i].data), result});
    }
  }

 private:
  io_context_t context_ = nullptr;
  std::vector<iocb> control_blocks_;  // one per piece slot
  std::vector<io_event> events_;
  std::vector<iocb*> staged_;
  std::vector<Completion> refused_;
};

}  // namespace

std::unique_ptr<IoEngine> make_libaio_engine(int queue_depth) {
  return std::make_unique<LibaioEngine>(queue_depth);
}

std::string probe_libaio() {
  io_context_t context = nullptr;
  const int status = io_setup(2, &context);
  if (status < 0) return "the kernel refused io_setup: " + describe_errno(-status);
  io_destroy(context);
  return "";
}

}  // namespace aio
}  // namespace deepspeed_cpp
