"""Host memory that building or loading a model under ZeRO-3 frees goes back to the kernel.

Under ``zero.Init`` each module's parameters exist whole only until its ``__init__`` returns, and
transformers' ``from_pretrained`` gathers one module at a time to load it: the memory these
freed is what keeps a rank below the whole model. With glibc it stays in the process: glibc
serves an allocation from the heap unless it is above its mmap threshold, which it raises (up to
32 MiB) each time an mmap'd block is freed, so after the first few parameters every whole tensor
comes from the heap, and the holes that long-lived shards pin between them are never handed back.
Measured with ``benchmarks/bench_hf_zero3_construction.py`` (a 436 MiB GPT-2, 2 ranks, target
227 MiB: the largest module whole plus one rank's shards): peak anonymous memory of
``from_config`` 259 and 836 MiB on the two ranks (``from_pretrained`` 521 and 563 MiB), of which
``malloc_trim(0)`` afterwards gave back all but the shards; with glibc's threshold fixed
(``MALLOC_MMAP_THRESHOLD_=131072``) 240 and 230 MiB. With the trims below, ``from_pretrained``
peaks at 240 and 242 MiB (``from_config`` 258 and 268 MiB with 32 MiB between trims: its
initialisation gathers a module with its children's parameters).

Fixing the threshold is process-wide and lasting (the NVMe path does it, offload/host_heap.py),
so here the freed pages are handed back instead: ``malloc_trim(0)`` (which also releases whole
free pages inside the heap) each time another ``TRIM_EVERY`` bytes of whole host parameters were
let go. Not glibc: nothing to do, nothing done.
"""

from __future__ import annotations

from .offload.host_heap import glibc

TRIM_EVERY = 16 << 20  # bytes: the most a rank holds above its live tensors between trims

_freed_since_trim = 0


def note_freed(params) -> None:
    """Counts the whole size of ``params`` (just partitioned or released; host ones only) and
    trims the heap once ``TRIM_EVERY`` bytes have been let go since the last trim."""
    global _freed_since_trim
    for param in params:
        tensor = param.ds_tensor
        if tensor.device.type == "cpu" and not param.ds_persist:
            _freed_since_trim += param.ds_numel * tensor.element_size()
    if _freed_since_trim >= TRIM_EVERY:
        _freed_since_trim = 0
        libc = glibc()
        if libc is not None:
            libc.malloc_trim(0)


__all__ = ["TRIM_EVERY", "note_freed"]
