"""DeepSpeed's ``deepspeed.ops.lion`` import path for ``DeepSpeedCPULion`` (defined in
``deepspeed_cpp.optim``), and ``FusedLion``, DeepSpeed's CUDA multi-tensor Lion, which
deepspeed_cpp does not have: constructing it raises, naming what to use instead."""

from ..optim import DeepSpeedCPULion


class FusedLion:
    """DeepSpeed's fused CUDA Lion: not in deepspeed_cpp."""

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "FusedLion: deepspeed_cpp has no fused CUDA Lion kernel; use DeepSpeedCPULion "
            "(deepspeed.ops.lion), passed to initialize(optimizer=...)"
        )


__all__ = ["DeepSpeedCPULion", "FusedLion"]
