"""DeepSpeed's module path for ``BF16_Optimizer``, the class name (for ``isinstance``) of a bf16
engine's optimizer without ZeRO (``runtime/zero/optimizer_kinds.py``)."""

from .zero.optimizer_kinds import BF16_Optimizer

__all__ = ["BF16_Optimizer"]
