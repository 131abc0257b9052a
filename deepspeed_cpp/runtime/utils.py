"""``deepspeed.runtime.utils`` names scripts call: ``see_memory_usage``."""

from __future__ import annotations

import gc
import os

from ..utils.logging import logger
from ..utils.timer import host_rss_bytes

_GIB = 1024**3


def _host_memory() -> tuple[int, int]:
    """(used, total) bytes of the host (Linux /proc/meminfo; (0, 0) where unreadable)."""
    try:
        fields = {}
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
        total = fields["MemTotal"]
        return total - fields.get("MemAvailable", fields.get("MemFree", 0)), total
    except (OSError, KeyError, ValueError):
        return 0, 0


def see_memory_usage(message: str, force: bool = False) -> str | None:
    """Logs (rank 0) device memory (allocated, its peak, reserved, its peak), the host's used
    memory and this process's RSS, under ``message``; only with ``force=True``, as DeepSpeed
    (which calls it at many points that would otherwise flood the log). Returns the text."""
    if not force:
        return None
    import torch.distributed as dist

    from ..accelerator import get_accelerator

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    gc.collect()  # what Python still holds only through cycles is not "in use"
    accelerator = get_accelerator()
    lines = [message]
    if accelerator.device_name() != "cpu":
        lines.append(
            f"MA {accelerator.memory_allocated() / _GIB:.2f} GB         "
            f"Max_MA {accelerator.max_memory_allocated() / _GIB:.2f} GB         "
            f"CA {accelerator.memory_reserved() / _GIB:.2f} GB         "
            f"Max_CA {accelerator.max_memory_reserved() / _GIB:.2f} GB "
        )
        accelerator.reset_peak_memory_stats()
    used, total = _host_memory()
    percent = 100.0 * used / total if total else 0.0
    lines.append(
        f"CPU Virtual Memory:  used = {used / _GIB:.2f} GB, percent = {percent:.1f}%, "
        f"process RSS = {host_rss_bytes() / _GIB:.2f} GB (pid {os.getpid()})"
    )
    text = "\n".join(lines)
    for line in lines:
        logger.info(line)
    return text


def set_random_seed(seed: int) -> None:
    """Seeds Python's, NumPy's (where installed) and torch's generators with ``seed``
    (DeepSpeed's ``deepspeed.runtime.utils.set_random_seed``, which pipeline scripts call)."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % (2**32))
