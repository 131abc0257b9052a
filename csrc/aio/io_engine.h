// The interface every I/O engine implements (io_uring, libaio, a pread/pwrite thread pool), and
// the choice among them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "io_piece.h"

namespace deepspeed_cpp {
namespace aio {

enum class EngineKind { kAuto, kIoUring, kLibaio, kThreads };

// One engine serves one worker thread: enqueue/submit/reap are called from that thread only.
// An engine never holds more than the `queue_depth` pieces it was made for.
class IoEngine {
 public:
  virtual ~IoEngine() = default;
  virtual EngineKind kind() const = 0;
  // Queues the piece's remainder (cursor_offset, cursor_buffer, remaining) on piece->fd; it
  // reaches the kernel at the latest at the next submit().
  virtual void enqueue(IoPiece* piece) = 0;
  // Hands every queued piece to the kernel. A piece the kernel refuses at submission completes
  // with that error through reap(), like any other.
  virtual void submit() = 0;
  // Appends finished pieces to `out`; when `block` is true, waits until at least one finishes.
  virtual void reap(std::vector<Completion>& out, bool block) = 0;
  // submit() then reap(out, true); io_uring does both in one system call.
  virtual void submit_and_reap(std::vector<Completion>& out) {
    submit();
    reap(out, /*block=*/true);
  }
};

// "auto", "io_uring", "libaio" or "threads"; anything else throws std::invalid_argument.
EngineKind parse_engine(const std::string& name);
const char* engine_name(EngineKind kind);

// The engines this library was compiled with, best first (threads is always there).
std::vector<EngineKind> compiled_engines();

// Empty when `kind` can run here; otherwise why not (not compiled in, refused by the kernel).
// The kernel is probed once per process and engine.
std::string engine_unavailable_reason(EngineKind kind);

// The engine a handle asking for `requested` gets: an explicit engine must be usable (else
// std::runtime_error with the reason); "auto" means DS_AIO_ENGINE when set, else the best usable.
EngineKind resolve_engine(EngineKind requested);

// A new engine of a resolved kind able to hold `queue_depth` pieces in flight.
std::unique_ptr<IoEngine> make_engine(EngineKind kind, int queue_depth);

// Defined by the engine sources the build includes (see the op builder).
std::unique_ptr<IoEngine> make_thread_pool_engine(int queue_depth);
#if DS_AIO_HAVE_LIBURING
std::unique_ptr<IoEngine> make_io_uring_engine(int queue_depth);
std::string probe_io_uring();
#endif
#if DS_AIO_HAVE_LIBAIO
std::unique_ptr<IoEngine> make_libaio_engine(int queue_depth);
std::string probe_libaio();
#endif

}  // namespace aio
}  // namespace deepspeed_cpp
