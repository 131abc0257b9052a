"""DeepSpeed's ``deepspeed.ops.lion`` import path for ``DeepSpeedCPULion`` (defined in
``deepspeed_cpp.optim``), and ``FusedLion``, DeepSpeed's CUDA multi-tensor Lion, which
deepspeed_cpp does not have: constructing it raises, naming what to use instead."""

from ..optim import DeepSpeedCPULion


class FusedLionUnavailableError(ValueError, NotImplementedError):
    """``FusedLion`` cannot be built here. A ValueError, as DeepSpeed 0.19.8 raises on its CPU
    accelerator ("This op had not been implemented on CPU backend."), so scripts catching that
    keep working; also a NotImplementedError, which is what it is."""


class FusedLion:
    """DeepSpeed's fused CUDA Lion: not in deepspeed_cpp.

    DeepSpeed 0.19.8 with ``DS_ACCELERATOR=cpu`` raises ``ValueError`` when it is constructed
    (its op builder has no CPU implementation); here it raises on every device.
    """

    def __init__(self, *args, **kwargs):
        raise FusedLionUnavailableError(
            "FusedLion: deepspeed_cpp has no fused Lion kernel (DeepSpeed's CPU backend has none "
            "either); use DeepSpeedCPULion (deepspeed.ops.lion), passed to "
            "initialize(optimizer=...), or the config's optimizer type 'Lion'"
        )


__all__ = ["DeepSpeedCPULion", "FusedLion", "FusedLionUnavailableError"]
