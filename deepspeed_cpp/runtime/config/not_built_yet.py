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
    # Offload of optimizer state or parameters to CPU/NVMe: lift with the offload issue.
    for part, device in zero.offload_devices().items():
        problems.append(
            f'zero_optimization.{part}.device = "{device}": not supported yet by deepspeed_cpp '
            f'(offload to {device} is being built); expected "none", or remove {part}'
        )
    return problems
