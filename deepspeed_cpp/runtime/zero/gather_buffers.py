"""Send and receive buffers of ZeRO-3's unit gathers, kept from one gather to the next.

A unit's gather needs a send buffer (this rank's shards, and the agreement's header) and a
receive buffer (every rank's, ``world`` times larger); both are dropped once the parameters are
copied out. Allocated afresh each time, a buffer above glibc's largest mmap threshold (32 MiB:
a 5.95M-element transformer layer gathered on 2 ranks receives 47.6 MB) is a fresh mapping
whose every page faults on first write: measured on this machine, filling a fresh 47.6 MB
tensor took 24.8 ms of CPU against 7.9 ms for a reused one, and a step gathers every unit once
or twice. So finished gathers hand their buffers back here and the next gather of the same size,
dtype and device takes them. At most ``2 x`` the largest buffer handed back is kept (the
oldest dropped first), so a model of many distinct unit sizes never keeps a copy of each.
"""

from __future__ import annotations

import torch


class GatherBuffers:
    """A small pool of flat buffers keyed by (numel, dtype, device)."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []  # oldest first
        self._held_bytes = 0
        self._cap_bytes = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements (contents undefined): a kept one if it fits
        exactly, else a new one."""
        for index, buffer in enumerate(self._free):
            if buffer.numel() == numel and buffer.dtype == dtype and buffer.device == device:
                del self._free[index]
                self._held_bytes -= _nbytes(buffer)
                return buffer
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Keeps ``buffer`` (no longer read or written by anyone) for a later ``take``."""
        size = _nbytes(buffer)
        self._cap_bytes = max(self._cap_bytes, 2 * size)
        self._free.append(buffer)
        self._held_bytes += size
        while self._held_bytes > self._cap_bytes:
            self._held_bytes -= _nbytes(self._free.pop(0))

    def held_bytes(self) -> int:
        return self._held_bytes

    def clear(self) -> None:
        self._free.clear()
        self._held_bytes = 0


def _nbytes(buffer: torch.Tensor) -> int:
    return buffer.numel() * buffer.element_size()
