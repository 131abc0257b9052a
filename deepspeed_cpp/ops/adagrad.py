"""DeepSpeed's ``deepspeed.ops.adagrad`` import path for ``DeepSpeedCPUAdagrad`` (defined in
``deepspeed_cpp.optim``): ``from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad`` reads the same
here."""

from ..optim import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
