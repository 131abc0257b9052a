"""Validated features that the engine does not have yet: the one place that refuses them.

The schema checks these settings fully (so a config is known to be right before the feature
lands); ``finalize()`` then refuses them here. When the engine gains a feature, delete its
entry below, and nothing else needs to change.
"""

from __future__ import annotations

from .sections import ZeroConfig


def refuse_features_not_built_yet(zero: ZeroConfig) -> list[str]:
    """One problem per configured feature that the engine cannot run yet."""
    problems = []
    part = zero.offload_optimizer
    if part is None or part.device == "none":
        return problems
    if part.super_offload:
        problems.append(
            "zero_optimization.offload_optimizer.super_offload = true: DeepSpeed's SuperOffload "
            "(for Grace-Hopper superchips) is not supported by deepspeed_cpp; expected false"
        )
    return problems
