"""torch.optim.Optimizer subclasses over the native ops."""

from .cpu_adagrad import DeepSpeedCPUAdagrad
from .cpu_adam import DeepSpeedCPUAdam
from .cpu_lion import DeepSpeedCPULion
from .fused_adam import FusedAdam

__all__ = ["DeepSpeedCPUAdagrad", "DeepSpeedCPUAdam", "DeepSpeedCPULion", "FusedAdam"]
