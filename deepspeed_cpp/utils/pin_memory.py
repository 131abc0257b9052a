"""DeepSpeed's ``deepspeed.utils.pin_memory``: its native pinned-memory backend, selected per
call by ``DS_PIN_MEMORY_BACKEND=native`` (any other value, or none, is torch's pinning, which on
the CPU accelerator leaves tensors as they are).

The native backend hands out copies (or fresh allocations) in page-locked host memory from the
aio library (``op_builder.PinMemoryBuilder``), tagged ``.ds_pinned``, and answers
``is_pinned`` for them and for any view into them by address range. ``unpin`` stops tracking an
allocation and returns True (False for memory it does not hold). Unlike DeepSpeed's, whose
``unpin`` frees at once (a later use of the tensor reads freed memory), the memory here goes back
when the last tensor viewing it is gone, so an unpinned tensor stays valid; an allocation nobody
unpins is returned and forgotten when its last view goes, as torch's pinned memory is.
"""

from __future__ import annotations

import os
import weakref

import torch

_shared_native_pins = None


def _has_real_storage(tensor: torch.Tensor) -> bool:
    # Meta and fake tensors have no host address to look up.
    if tensor.device.type != "cpu" or type(tensor).__name__ == "FakeTensor":
        return False
    try:
        return tensor.untyped_storage().data_ptr() != 0
    except (RuntimeError, NotImplementedError):
        return False


class NativePinnedMemory:
    """Page-locked host tensors from the aio library, tracked by address range."""

    def __init__(self):
        from ..ops import op_builder  # looked up on use: DeepSpeed's tests replace the builder

        try:
            aio = op_builder.PinMemoryBuilder().load()
        except Exception as error:
            raise RuntimeError(
                f"DS_PIN_MEMORY_BACKEND=native: the pin_memory op (deepspeed_cpp's aio library) "
                f"cannot be loaded: {error}; unset DS_PIN_MEMORY_BACKEND to pin with torch"
            ) from error
        self._handle = aio.AsyncIOHandle()
        self._ranges: dict[int, int] = {}  # start address -> end address of each allocation
        self._allocations: dict[int, weakref.ref] = {}  # start address -> the allocation

    def pin(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True):
        """A page-locked tensor of ``tensor``'s dtype: its shape (``match_shape``) or flat, a
        copy of its values (``make_copy``) or uninitialised."""
        shape = tuple(tensor.shape) if match_shape else (tensor.numel(),)
        locked = self.pin_empty(tensor, shape)
        if make_copy:
            locked.copy_(tensor.reshape(shape))
        return locked

    def pin_empty(self, example: torch.Tensor, shape) -> torch.Tensor:
        """An uninitialised page-locked tensor of ``shape`` in ``example``'s dtype."""
        numel = 1
        for size in shape:
            numel *= int(size)
        allocation = self._handle.new_cpu_locked_tensor(numel, example)
        start = allocation.data_ptr()
        self._ranges[start] = start + allocation.nbytes
        self._allocations[start] = weakref.ref(allocation)
        # The views keep ``allocation`` alive; when the last goes, the memory goes and so must
        # its range (a later allocation may reuse the address).
        weakref.finalize(allocation, self._forget, start)
        locked = allocation.view(shape)
        locked.ds_pinned = True
        locked.ds_pin_base = start
        return locked

    def _forget(self, start: int) -> None:
        self._ranges.pop(start, None)
        self._allocations.pop(start, None)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        if getattr(tensor, "ds_pinned", False):
            return True
        if not _has_real_storage(tensor):
            return False
        address = tensor.data_ptr()
        return any(start <= address < end for start, end in self._ranges.items())

    def unpin(self, tensor: torch.Tensor) -> bool:
        """Stops tracking ``tensor``'s allocation: True if it was one of ours."""
        start = getattr(tensor, "ds_pin_base", None)
        if start is None and _has_real_storage(tensor):
            start = tensor.data_ptr()
        if start not in self._ranges:
            return False
        allocation = self._allocations[start]()
        if allocation is not None:
            # The aio handle lets go of it; the memory returns with the last view.
            self._handle.free_cpu_locked_tensor(allocation)
        self._forget(start)
        if hasattr(tensor, "ds_pinned"):
            tensor.ds_pinned = False
        return True


def get_native_pinned_memory() -> NativePinnedMemory:
    """The process's native backend (built on first use)."""
    global _shared_native_pins
    if _shared_native_pins is None:
        _shared_native_pins = NativePinnedMemory()
    return _shared_native_pins


def get_active_native_pinned_memory() -> NativePinnedMemory | None:
    """The native backend when ``DS_PIN_MEMORY_BACKEND=native``, else None (torch pins).
    Raises RuntimeError naming the pin_memory op when native is asked for but cannot load."""
    if os.environ.get("DS_PIN_MEMORY_BACKEND", "torch").strip().lower() != "native":
        return None
    return get_native_pinned_memory()
