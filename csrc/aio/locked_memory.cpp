#include "locked_memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <new>

namespace deepspeed_cpp {
namespace aio {
namespace {

std::size_t mapped_size(std::size_t bytes) {
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  const std::size_t at_least_one = bytes == 0 ? 1 : bytes;
  return (at_least_one + page - 1) / page * page;
}

}  // namespace

void* allocate_locked(std::size_t bytes) {
  const std::size_t size = mapped_size(bytes);
  void* memory = mmap(nullptr, size, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
  if (memory == MAP_FAILED) throw std::bad_alloc();
  // Best effort (see the header): a failed lock leaves ordinary, already-faulted pages.
  (void)mlock(memory, size);
  return memory;
}

void free_locked(void* memory, std::size_t bytes) noexcept {
  if (memory == nullptr) return;
  const std::size_t size = mapped_size(bytes);
  (void)munlock(memory, size);
  (void)munmap(memory, size);
}

}  // namespace aio
}  // namespace deepspeed_cpp
