"""DeepSpeed's ``deepspeed.ops.adam`` import path for ``DeepSpeedCPUAdam``, ``FusedAdam``
(defined in ``deepspeed_cpp.optim``): ``from deepspeed.ops.adam import DeepSpeedCPUAdam`` reads the
same here."""

from ..optim import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
