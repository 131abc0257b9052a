"""DeepSpeed's module path for ``FP16_UnfusedOptimizer`` (``runtime/zero/optimizer_kinds.py``)."""

from ..zero.optimizer_kinds import FP16_UnfusedOptimizer

__all__ = ["FP16_UnfusedOptimizer"]
