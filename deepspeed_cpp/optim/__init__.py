"""torch.optim.Optimizer subclasses over the native ops."""

from .cpu_adam import DeepSpeedCPUAdam

__all__ = ["DeepSpeedCPUAdam"]
