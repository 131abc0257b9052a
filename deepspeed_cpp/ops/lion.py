"""DeepSpeed's ``deepspeed.ops.lion`` import path for ``DeepSpeedCPULion``
(defined in ``deepspeed_cpp.optim``): ``from deepspeed.ops.lion import DeepSpeedCPULion`` reads the
same here."""

from ..optim import DeepSpeedCPULion

__all__ = ["DeepSpeedCPULion"]
