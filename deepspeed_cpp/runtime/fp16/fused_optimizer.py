"""DeepSpeed's module path for ``FP16_Optimizer`` (``runtime/zero/optimizer_kinds.py``)."""

from ..zero.optimizer_kinds import FP16_Optimizer

__all__ = ["FP16_Optimizer"]
