"""Gives back the pages of a memory-mapped checkpoint file once their bytes have been copied.

Shard and module files are read through ``torch.load(mmap=True)``: a slice copied out of the map
leaves its pages resident in this process (they count in its RSS and high-water mark) until the
whole map is dropped, so a load that copies a rank's slices one sub-group at a time would still
end holding every page it read. ``MappedFile.release(view)`` drops the pages under a view (and
``release_all`` those of the whole map) with ``madvise(MADV_DONTNEED)``: the map is private and
never written, so a page touched again is read back from the page cache (or the file), never
lost.

The pages released are only ever those inside the address ranges at which this process maps
the file (``/proc/self/maps``), so a view that is not a map of it — or a platform without that
file — releases nothing.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import torch

_PAGE = mmap.PAGESIZE
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
_libc = None


def _madvise(start: int, length: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    # A failure only means the pages stay resident: nothing to report.
    _libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_DONTNEED)


def mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The [start, end) address ranges at which this process maps ``path`` (Linux), else []."""
    if _MADV_DONTNEED is None:
        return []
    try:
        status = os.stat(path)
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or int(fields[4]) != status.st_ino:
            continue
        try:
            same = os.path.samefile(fields[5].rstrip("\n"), path)
        except OSError:
            same = False
        if same:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((low, high))
    return ranges


class MappedFile:
    """One memory-mapped checkpoint file: the address ranges of its map."""

    def __init__(self, path: Path) -> None:
        self.ranges = mapped_ranges(path)

    def release_all(self) -> None:
        """Drops every resident page of the map: reading a few bytes maps their neighbours too
        (the kernel's fault-around, 64 KiB), pages no slice of this rank may ever release."""
        for low, high in self.ranges:
            _madvise(low, high - low)

    def release(self, view: torch.Tensor) -> None:
        """Drops the pages holding ``view``'s bytes (whole pages; the map is read-only data)."""
        if not self.ranges or view.numel() == 0:
            return
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        start, end = start - start % _PAGE, -(-end // _PAGE) * _PAGE
        for low, high in self.ranges:
            lo, hi = max(start, low), min(end, high)
            if lo < hi:
                _madvise(lo, hi - lo)
