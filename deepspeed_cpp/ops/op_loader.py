"""Loads an op family's library once per process and registers its fake (meta) kernels.

Every op module (cpu_adam, cpu_adagrad, cpu_lion, fused_adam, zero, aio) holds one ``OpLoader``.
Its wrappers check ``loader.ready`` (one attribute read) before each call and load on the first
one: loading may compile the library, which must happen in eager mode, outside torch.compile's
tracing, and registering a fake kernel twice is an error.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .op_builder import OpBuilder


class OpLoader:
    """``builder``'s library, loaded on first ``load()``, with ``fakes`` (op name → meta kernel
    in the ``deepspeed_cpp`` namespace) registered once it is."""

    def __init__(self, builder: OpBuilder, fakes: dict[str, Callable] | None = None):
        self.builder = builder
        self._fakes = dict(fakes or {})
        self.ready = False

    def load(self) -> None:
        if self.ready:
            return
        self.builder.load()
        for name, fake in self._fakes.items():
            torch.library.register_fake(f"deepspeed_cpp::{name}")(fake)
        self.ready = True
