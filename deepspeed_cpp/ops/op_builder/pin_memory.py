"""DeepSpeed's ``PinMemoryBuilder`` (the op behind its native pinned-memory backend,
``DS_PIN_MEMORY_BACKEND=native``). Here page-locked host memory comes from the aio library
(``AsyncIOHandle.new_cpu_locked_tensor``: page-aligned, ``mlock``-ed, or CUDA-pinned where a
GPU is present), so this builder stands for that library under DeepSpeed's name."""

from __future__ import annotations

import importlib

from .aio import AsyncIOBuilder


class PinMemoryBuilder:
    """``load()`` returns ``deepspeed_cpp.ops.aio`` (its ``AsyncIOHandle`` allocates the
    locked tensors); ``is_compatible()`` is the aio library's answer."""

    NAME = "pin_memory"
    BUILD_VAR = "DS_BUILD_AIO"

    def is_compatible(self, verbose: bool = False) -> tuple[bool, str]:
        return AsyncIOBuilder().is_compatible()

    def load(self, verbose: bool = False):
        AsyncIOBuilder().load(verbose=verbose)
        return importlib.import_module("deepspeed_cpp.ops.aio")
