// One block of one file request as it travels through an I/O engine, and its completion.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace deepspeed_cpp {
namespace aio {

// O_DIRECT needs the file offset, the length and the memory address aligned to the device's
// logical block. A page is a multiple of every logical block size in use, so page alignment is
// always enough; it is also what the allocator of pinned tensors hands out.
constexpr int64_t kDirectIoAlignment = 4096;

enum class IoDirection { kRead, kWrite };

class FileRequest;
struct WorkSlice;

// A contiguous byte range of one request, moved with one system call per submission. A short
// transfer advances `done` and the rest goes back to the engine, so a piece completes only when
// all `length` bytes moved or an error stopped it.
struct IoPiece {
  std::shared_ptr<WorkSlice> slice;  // keeps the slice and its request alive while in flight
  FileRequest* request = nullptr;
  int slot = -1;  // index in the worker's piece pool; engines may keep per-slot state
  bool is_read = true;
  int fd = -1;                  // the descriptor of this submission (direct or buffered)
  bool direct = false;          // whether `fd` is the O_DIRECT descriptor
  char* io_buffer = nullptr;    // where the kernel reads or writes: the tensor or a bounce
  char* user_buffer = nullptr;  // the tensor's bytes for this piece
  bool bounced = false;         // io_buffer is the slot's bounce buffer
  int64_t file_offset = 0;      // of the first byte of the piece
  int64_t length = 0;           // bytes of the piece
  int64_t done = 0;             // bytes already transferred
  int retries = 0;              // EINTR/EAGAIN resubmissions of the current remainder
  // Set when an O_DIRECT transfer of this piece failed with EINVAL and the piece goes on
  // buffered: what that transfer was, for the warning if the buffered retry succeeds.
  std::string direct_refusal;

  char* cursor_buffer() const { return io_buffer + done; }
  int64_t cursor_offset() const { return file_offset + done; }
  int64_t remaining() const { return length - done; }
};

// What the kernel (or a pool thread) answered for one submission: bytes moved, or -errno.
struct Completion {
  IoPiece* piece;
  int64_t result;
};

}  // namespace aio
}  // namespace deepspeed_cpp
