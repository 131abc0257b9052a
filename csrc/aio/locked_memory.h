// Page-aligned host memory locked into RAM: the bounce buffers and the tensors of
// new_cpu_locked_tensor, which O_DIRECT can read into and write from without a copy.
#pragma once

#include <cstddef>

namespace deepspeed_cpp {
namespace aio {

// At least `bytes` bytes (at least one page), page-aligned and pre-faulted. Locking into RAM is
// best effort: without CAP_IPC_LOCK the memory-lock limit may refuse it, and the memory is still
// usable, just pageable. Throws std::bad_alloc when the mapping fails.
void* allocate_locked(std::size_t bytes);

// Releases what allocate_locked(bytes) returned, with the same `bytes`.
void free_locked(void* memory, std::size_t bytes) noexcept;

}  // namespace aio
}  // namespace deepspeed_cpp
