// One async_pread/async_pwrite call: its file descriptors, its byte layout and its outcome.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "io_piece.h"

namespace deepspeed_cpp {
namespace aio {

struct RequestSpec {
  IoDirection direction;
  char* buffer;  // the tensor's bytes
  int64_t bytes;
  std::string path;
  int64_t file_offset;
  // For writes at offset 0: make the file end where the write ends (it replaces the file).
  // False keeps a longer file's length, for writing a file in parts.
  bool truncate = true;
};

// Opened in the submitting thread, so that requests to one file take effect in program order
// (a write at offset 0 resizes the file before later writes to it are issued). Every problem is
// recorded, never thrown: the handle's wait() reports it with the request's description.
//
// The range is laid out as a head, a body and a tail: the body is the page-aligned middle and
// goes through the O_DIRECT descriptor in block_size pieces; the unaligned head and tail (each
// less than a page) go through a buffered descriptor of the same file.
class FileRequest {
 public:
  explicit FileRequest(RequestSpec spec);
  ~FileRequest();
  FileRequest(const FileRequest&) = delete;
  FileRequest& operator=(const FileRequest&) = delete;

  const RequestSpec& spec() const { return spec_; }
  bool is_read() const { return spec_.direction == IoDirection::kRead; }
  int64_t begin() const { return spec_.file_offset; }
  int64_t end() const { return spec_.file_offset + spec_.bytes; }
  int64_t body_begin() const { return body_begin_; }
  int64_t body_end() const { return body_end_; }
  char* user_buffer_at(int64_t file_offset) const {
    return spec_.buffer + (file_offset - spec_.file_offset);
  }

  int direct_fd() const { return direct_fd_; }
  int buffered_fd() const { return buffered_fd_; }
  // False when the file system refused O_DIRECT (at open, or later with EINVAL).
  bool direct_allowed() const { return direct_allowed_.load(std::memory_order_relaxed); }
  void stop_direct_io() { direct_allowed_.store(false, std::memory_order_relaxed); }
  // Set when open(O_DIRECT) was refused and the request runs buffered.
  const std::string& direct_refusal() const { return direct_refusal_; }

  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // Records why the request failed; the first reason is kept.
  void fail(const std::string& detail);
  // "write of 4096 bytes to '/x' at file offset 0 failed: <detail>"; empty when it succeeded.
  std::string error_message() const;
  // "write of 4096 bytes to '/x' at file offset 0"
  std::string describe() const;

  // Slices of this request not yet finished by the workers.
  std::atomic<int> open_slices{0};

 private:
  void open_file();
  void size_file_for_write();

  RequestSpec spec_;
  int64_t body_begin_;
  int64_t body_end_;
  int direct_fd_ = -1;
  int buffered_fd_ = -1;
  std::atomic<bool> direct_allowed_{true};
  std::string direct_refusal_;
  std::atomic<bool> failed_{false};
  mutable std::mutex error_mutex_;
  std::string error_;
};

}  // namespace aio
}  // namespace deepspeed_cpp
