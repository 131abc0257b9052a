"""csrc/moe: the Mixture-of-Experts gating op; CPU library, and its CUDA kernel built with nvcc."""

from __future__ import annotations

from .builder import OpBuilder
from .fused_adam import FusedAdamBuilder

_COMMON_SOURCES = ["moe/gating_checks.cpp"]


class MoEBuilder(OpBuilder):
    """csrc/moe on the CPU: top-k gating, capacity positions, drop mask and combine weights."""

    NAME = "moe"

    def sources(self) -> list[str]:
        return ["moe/gating_op.cpp", "moe/gating_kernel.cpp", *_COMMON_SOURCES]


class MoECudaBuilder(FusedAdamBuilder):
    """csrc/moe's CUDA kernel (the same per-token body, gating_token.h, compiled by nvcc).

    Needs what the fused Adam build needs (a CUDA build of torch and a matching nvcc, no GPU),
    and inherits its architecture list, checks and toolkit lookup.
    """

    NAME = "moe_cuda"

    def sources(self) -> list[str]:
        return ["moe/gating_cuda_op.cpp", *_COMMON_SOURCES, "moe/gating_kernel.cu"]
