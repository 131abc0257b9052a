// The primary engine: one io_uring per worker, sized to the queue depth. Submissions are batched
// into one io_uring_enter per submit(); completions are drained in batches.
#include <liburing.h>

#include <cerrno>
#include <stdexcept>
#include <string>

#include "io_engine.h"
#include "os_error.h"

namespace deepspeed_cpp {
namespace aio {
namespace {

class IoUringEngine final : public IoEngine {
 public:
  explicit IoUringEngine(int queue_depth) {
    const int status = io_uring_queue_init(static_cast<unsigned>(queue_depth), &ring_, 0);
    if (status < 0) {
      throw std::runtime_error("io_uring_queue_init(" + std::to_string(queue_depth) +
                               ") failed: " + describe_errno(-status));
    }
  }

  ~IoUringEngine() override { io_uring_queue_exit(&ring_); }

  EngineKind kind() const override { return EngineKind::kIoUring; }

  void enqueue(IoPiece* piece) override {
    // Never null: a worker keeps at most queue_depth pieces in flight and the ring holds at
    // least that many entries.
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    if (piece->is_read) {
      io_uring_prep_read(sqe, piece->fd, piece->cursor_buffer(),
                         static_cast<unsigned>(piece->remaining()), piece->cursor_offset());
    } else {
      io_uring_prep_write(sqe, piece->fd, piece->cursor_buffer(),
                          static_cast<unsigned>(piece->remaining()), piece->cursor_offset());
    }
    io_uring_sqe_set_data(sqe, piece);
    ++staged_;
  }

  void submit() override {
    if (staged_ == 0) return;
    // The kernel may stop consuming entries at one that fails (its error then arrives as a
    // completion); what it left in the ring goes in the next round.
    while (io_uring_sq_ready(&ring_) > 0) {
      const int submitted = io_uring_submit(&ring_);
      if (submitted == -EINTR || submitted == -EAGAIN || submitted == -EBUSY) continue;
      // A failed io_uring_enter means the ring itself is broken, and the pieces already in
      // flight can no longer be accounted for: the worker stops the process (see io_worker).
      if (submitted < 0) {
        throw std::runtime_error("io_uring_submit failed: " + describe_errno(-submitted));
      }
    }
    staged_ = 0;
  }

  void submit_and_reap(std::vector<Completion>& out) override {
    if (staged_ > 0) {
      int submitted;
      do {
        submitted = io_uring_submit_and_wait(&ring_, 1);
      } while (submitted == -EINTR || submitted == -EAGAIN || submitted == -EBUSY);
      if (submitted < 0) {
        throw std::runtime_error("io_uring_submit_and_wait failed: " + describe_errno(-submitted));
      }
      submit();  // whatever the kernel left in the ring, if anything
    }
    reap(out, /*block=*/true);
  }

  void reap(std::vector<Completion>& out, bool block) override {
    io_uring_cqe* cqe = nullptr;
    if (block) {
      int status;
      do {
        status = io_uring_wait_cqe(&ring_, &cqe);
      } while (status == -EINTR || status == -EAGAIN);
      if (status < 0) {
        throw std::runtime_error("io_uring_wait_cqe failed: " + describe_errno(-status));
      }
    }
    unsigned head;
    unsigned seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      out.push_back(Completion{static_cast<IoPiece*>(io_uring_cqe_get_data(cqe)), cqe->res});
      ++seen;
    }
    io_uring_cq_advance(&ring_, seen);
  }

 private:
  io_uring ring_{};
  int staged_ = 0;  // entries prepared since the last submit
};

}  // namespace

std::unique_ptr<IoEngine> make_io_uring_engine(int queue_depth) {
  return std::make_unique<IoUringEngine>(queue_depth);
}

std::string probe_io_uring() {
  io_uring ring{};
  const int status = io_uring_queue_init(2, &ring, 0);
  if (status < 0) return "the kernel refused io_uring_queue_init: " + describe_errno(-status);
  std::string reason;
  io_uring_probe* probe = io_uring_get_probe_ring(&ring);
  if (probe == nullptr) {
    reason = "the kernel cannot report its io_uring operations (it predates Linux 5.6)";
  } else {
    if (!io_uring_opcode_supported(probe, IORING_OP_READ) ||
        !io_uring_opcode_supported(probe, IORING_OP_WRITE)) {
      reason = "this kernel's io_uring lacks IORING_OP_READ/IORING_OP_WRITE (needs Linux 5.6+)";
    }
    io_uring_free_probe(probe);
  }
  io_uring_queue_exit(&ring);
  return reason;
}

}  // namespace aio
}  // namespace deepspeed_cpp
