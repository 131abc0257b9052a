#include "file_request.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "os_error.h"

namespace deepspeed_cpp {
namespace aio {
namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// The size of the open file, or -1 with errno set. statx (glibc 2.28) rather than fstat, whose
// symbol is glibc 2.33's and would keep the library from loading on a manylinux_2_28 system;
// fstat where the C library has no statx (glibc before 2.28, where fstat is an older symbol).
int64_t file_size(int fd) {
#ifdef STATX_SIZE
  struct statx status;
  if (statx(fd, "", AT_EMPTY_PATH, STATX_SIZE, &status) != 0) return -1;
  return static_cast<int64_t>(status.stx_size);
#else
  struct stat status;
  if (fstat(fd, &status) != 0) return -1;
  return static_cast<int64_t>(status.st_size);
#endif
}

int open_retrying(const char* path, int flags) {
  int fd;
  do {
    fd = open(path, flags | O_CLOEXEC, 0644);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

}  // namespace

FileRequest::FileRequest(RequestSpec spec) : spec_(std::move(spec)) {
  const int64_t aligned_begin = round_up(begin(), kDirectIoAlignment);
  const int64_t aligned_end = end() / kDirectIoAlignment * kDirectIoAlignment;
  if (aligned_begin < aligned_end) {
    body_begin_ = aligned_begin;
    body_end_ = aligned_end;
  } else {  // no whole aligned page inside: the request is one buffered piece
    body_begin_ = body_end_ = end();
  }
  open_file();
  if (!failed() && !is_read()) size_file_for_write();
}

FileRequest::~FileRequest() {
  if (direct_fd_ >= 0) close(direct_fd_);
  if (buffered_fd_ >= 0) close(buffered_fd_);
}

void FileRequest::open_file() {
  const int access = is_read() ? O_RDONLY : (O_WRONLY | O_CREAT);
  const char* path = spec_.path.c_str();
  direct_fd_ = open_retrying(path, access | O_DIRECT);
  if (direct_fd_ < 0) {
    if (errno != EINVAL) {
      fail(std::string("cannot open the file for ") + (is_read() ? "reading" : "writing") + ": " +
           describe_errno(errno));
      return;
    }
    // EINVAL from open(O_DIRECT) means the file system has no direct I/O (e.g. ramfs, and
    // tmpfs before Linux 6.6): the request runs buffered.
    direct_refusal_ = describe_errno(EINVAL);
    stop_direct_io();
  }
  buffered_fd_ = open_retrying(path, access);
  if (buffered_fd_ < 0) {
    fail(std::string("cannot open the file for ") + (is_read() ? "reading" : "writing") + ": " +
         describe_errno(errno));
    return;
  }
  if (is_read()) {
    const int64_t size = file_size(buffered_fd_);
    if (size >= 0 && size < end()) {
      fail("the file has " + std::to_string(size) + " bytes, but the request reads up " +
           "to byte " + std::to_string(end()) + " (reading past the end of the file)");
    }
  }
}

void FileRequest::size_file_for_write() {
  const int64_t size = file_size(buffered_fd_);
  if (size < 0) {
    fail("cannot stat the file: " + describe_errno(errno));
    return;
  }
  // A write at offset 0 replaces the file: it ends where the write ends. Shrinking instead of
  // truncating to zero keeps the blocks that the write overwrites allocated, which is much
  // faster for O_DIRECT than allocating them again.
  if (spec_.truncate && spec_.file_offset == 0 && size > end()) {
    if (ftruncate(buffered_fd_, end()) != 0) {
      fail("cannot shrink the file to " + std::to_string(end()) +
           " bytes: " + describe_errno(errno));
      return;
    }
  }
  // Allocating the part beyond the current end in one call lets the direct writes fill
  // allocated space, and reports a full disk before any byte is written.
  const int64_t grow_from = size > begin() ? size : begin();
  if (end() > grow_from) {
    int allocated;
    do {
      allocated = fallocate(buffered_fd_, 0, grow_from, end() - grow_from);
    } while (allocated != 0 && errno == EINTR);
    const int error = allocated == 0 ? 0 : errno;
    // EOPNOTSUPP: the file system cannot preallocate (unlike posix_fallocate, fallocate does not
    // emulate it by writing zeros); the writes allocate instead.
    if (error != 0 && error != EOPNOTSUPP && error != ENOSYS) {
      fail("cannot allocate bytes " + std::to_string(grow_from) + " to " + std::to_string(end()) +
           " of the file: " + describe_errno(error));
    }
  }
}

void FileRequest::fail(const std::string& detail) {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (error_.empty()) error_ = detail;
  failed_.store(true, std::memory_order_release);
}

std::string FileRequest::describe() const {
  return std::string(is_read() ? "read of " : "write of ") + std::to_string(spec_.bytes) +
         (is_read() ? " bytes from '" : " bytes to '") + spec_.path + "' at file offset " +
         std::to_string(spec_.file_offset);
}

std::string FileRequest::error_message() const {
  std::lock_guard<std::mutex> lock(error_mutex_);
  if (error_.empty()) return "";
  return describe() + " failed: " + error_;
}

}  // namespace aio
}  // namespace deepspeed_cpp
