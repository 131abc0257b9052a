"""Freed host memory goes back to the kernel while NVMe offload runs.

NVMe offload exists to keep the optimizer state out of host memory, yet with glibc's defaults a
process that swaps still holds hundreds of MiB it no longer uses. glibc serves a large
allocation with mmap (returned to the kernel on free) only above its mmap threshold, and it
raises that threshold, up to 32 MiB, every time such a block is freed: after the first few
steps, every tensor up to 32 MiB (activations, gradient buckets, transient copies) comes from
the heap, and freed heap memory in the middle of the heap is kept by the process. Measured with
``benchmarks/bench_offload.py`` (50M parameters, one process, ZeRO-2 NVMe): peak RSS 1981 MiB
with the defaults, 1423 MiB with a fixed threshold; ``malloc_trim(0)`` after the steps left
1364 MiB, so the difference was memory the allocator held, not live tensors.

Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``) stops the raising, so large frees are
returned at once. What was freed in the heap before the threshold was fixed (building the model
in float32 and casting it, the engine's own set-up copies) stays resident in holes the steps
never reuse: once the engine is ready, ``malloc_trim(0)`` gives those pages back. Measured at
``benchmarks/bench_offload.py``'s sizes (201M parameters, 2 processes, ZeRO-2 NVMe):
the heap held 350 MB free of 490 MB after set-up; one trim lowered the steps' peak RSS from
2442 to 2122 MiB per rank, and the steps after it fault none of those pages back in.

Both are process-wide, so they are applied only when the engine swaps to NVMe (the threshold
once per process, the trim once per engine) and are switched off together with
``DS_CPP_MMAP_THRESHOLD`` (bytes, or ``off``). Not glibc (musl, macOS): nothing to do, nothing done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger("deepspeed_cpp")

ENV = "DS_CPP_MMAP_THRESHOLD"
DEFAULT_THRESHOLD = 1 << 20  # 1 MiB: tensors of at least 1 MiB go straight back when freed
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
GLIBC_MAX_THRESHOLD = 32 << 20  # HEAP_MAX_SIZE / 2 on 64-bit: mallopt refuses anything larger

_applied: int | None = None


def _requested_threshold() -> int | None:
    """The threshold DS_CPP_MMAP_THRESHOLD asks for (None: leave glibc's default)."""
    raw = os.environ.get(ENV)
    if raw is None:
        return DEFAULT_THRESHOLD
    if raw.strip().lower() in ("off", "0", "none", ""):
        return None
    try:
        threshold = int(raw)
    except ValueError:
        raise ValueError(
            f"{ENV}={raw!r}: expected a byte count (e.g. {DEFAULT_THRESHOLD}) or 'off'"
        ) from None
    if not 0 < threshold <= GLIBC_MAX_THRESHOLD:
        raise ValueError(
            f"{ENV}={threshold}: expected 1 to {GLIBC_MAX_THRESHOLD} bytes (glibc's limit) or 'off'"
        )
    return threshold


def return_large_frees_to_the_kernel() -> int | None:
    """Fixes glibc's mmap threshold for this process (see the module docstring). Returns the
    threshold in effect, or None when left alone (switched off, or not glibc)."""
    global _applied
    threshold = _requested_threshold()
    if threshold is None or _applied == threshold:
        return threshold
    libc = glibc()
    if libc is None:
        return None  # not glibc: its allocator has no such threshold to fix
    if libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(threshold)) != 1:
        logger.warning(
            "mallopt(M_MMAP_THRESHOLD, %d) refused; host memory may stay held", threshold
        )
        return None
    _applied = threshold
    logger.info(
        "NVMe offload: glibc mmap threshold fixed at %d bytes so freed tensors leave the process "
        "(%s=off keeps glibc's default)",
        threshold,
        ENV,
    )
    return threshold


def give_back_free_heap() -> None:
    """Once an engine that swaps is ready: hands the heap's free pages back (see the module
    docstring). Only where the threshold was fixed, under the same switch."""
    libc = glibc()
    if _applied is not None and libc is not None:
        libc.malloc_trim(0)


def glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has mallopt, malloc_trim and gnu_get_libc_version),
    else None; looked up once (find_library runs ldconfig)."""
    global _libc
    if _libc is False:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
        except OSError:
            libc = None
        functions = ("mallopt", "malloc_trim", "gnu_get_libc_version")
        _libc = libc if libc is not None and all(hasattr(libc, f) for f in functions) else None
    return _libc


_libc: ctypes.CDLL | None | bool = False  # False: not looked up yet
