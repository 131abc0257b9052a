"""``deepspeed.runtime.utils`` names scripts call: ``see_memory_usage``, ``call_to_str``,
``move_to_device`` / ``copy_to_device``, ``set_random_seed``, ``is_model_parallel_parameter``,
``count_used_parameters_in_backward``; the gradient-norm helpers (``grad_norms.py``) and the layer
partitioning helpers (``layer_partitions.py``) under the same module.

Left out: ``PartitionedTensor`` (pipeline parallelism's activation transport) and the ZeRO/
pipeline internals DeepSpeed keeps here.
"""

from __future__ import annotations

import gc
import os
import random

import torch

from ..utils.logging import logger
from ..utils.timer import host_rss_bytes
from .grad_norms import (  # noqa: F401 - DeepSpeed's names, re-exported
    CheckOverflow,
    clip_grad_norm_,
    get_global_norm,
    get_weight_norm,
    has_inf_or_nan,
)
from .layer_partitions import (  # noqa: F401 - DeepSpeed's names, re-exported
    partition_balanced,
    partition_uniform,
    prefix_sum_inc,
)
from .model_parallel import is_model_parallel_parameter  # noqa: F401 - DeepSpeed's name

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


def call_to_str(base: str, *args, **kwargs) -> str:
    """``base(arg, ..., key=value, ...)`` with each value's repr."""
    arguments = [repr(arg) for arg in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(arguments)})"


def set_random_seed(seed: int) -> None:
    """Seeds Python's, NumPy's (where installed; modulo 2**32) and torch's (modulo 2**63)
    generators: DeepSpeed's ``deepspeed.runtime.utils.set_random_seed``, which pipeline scripts
    call."""
    random.seed(seed)
    torch.manual_seed(seed % (2**63))
    try:
        import numpy
    except ImportError:
        return
    numpy.random.seed(seed % (2**32))


def copy_to_device(item, device, criterion_func):
    """A copy of ``item`` with every element passing ``criterion_func`` (tensors, inside nested
    lists, tuples and dicts) moved to ``device``; other elements unchanged."""
    if criterion_func(item):
        return item.to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(copy_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: copy_to_device(v, device, criterion_func) for k, v in item.items()}
    return item


def move_to_device(item, device, criterion_func=None):
    """``item`` (a tensor, or nested lists/tuples/dicts of them) on ``device``. Without
    ``criterion_func`` every leaf is ``.to(device)``; with it, the matching tensors are moved in
    place (their ``.data`` replaced, so other references see the move) and the rest kept."""
    if criterion_func is not None and criterion_func(item):
        item.data = item.to(device).data
        return item
    if isinstance(item, (list, tuple)):
        return type(item)(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    if criterion_func is not None:
        return item
    return item.to(device)


def count_used_parameters_in_backward(parameters) -> int:
    """How many of ``parameters`` take part in the backward pass now running (call it from a
    backward hook): those whose gradient-accumulation node the autograd engine will execute."""
    from torch.autograd.graph import _get_grad_fn_or_grad_acc

    if torch._C._current_graph_task_id() == -1:
        raise RuntimeError(
            "count_used_parameters_in_backward must be called during a backward pass (from a "
            "backward hook)"
        )
    nodes = set()
    for param in parameters:
        if isinstance(param, torch.Tensor) and param.requires_grad:
            with torch.enable_grad():  # hooks run with grad mode off; the lookup needs it on
                node = _get_grad_fn_or_grad_acc(param)
            if node is not None:
                nodes.add(node)
    return sum(bool(torch._C._will_engine_execute_node(node)) for node in nodes)
