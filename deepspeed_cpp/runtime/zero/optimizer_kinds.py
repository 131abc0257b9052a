"""DeepSpeed's optimizer wrapper class names, for ``isinstance`` on what ``initialize`` returns.

DeepSpeed hands back a different wrapper class per configuration (``DeepSpeedZeroOptimizer`` at
stages 1-2, ``DeepSpeedZeroOptimizer_Stage3`` at stage 3, ``BF16_Optimizer`` / ``FP16_Optimizer``
/ ``FP16_UnfusedOptimizer`` for low precision without ZeRO); scripts and DeepSpeed's tests test
for them with ``isinstance``. Ours is one stage object per stage, so each name here is a class
whose ``isinstance`` answers from the object's configuration: an engine's optimizer is an
instance of exactly the name DeepSpeed would have returned for the same config. Measured with
DeepSpeed 0.19.8 (``DS_ACCELERATOR=cpu``, 2 ranks): at stage 0 fp16 and bf16 alike get
``FP16_Optimizer`` when the optimizer is FusedAdam (the config's Adam/AdamW) and
``FP16_UnfusedOptimizer`` for any other (a client's ``torch.optim.Adam`` included);
``BF16_Optimizer`` is DeepSpeed's pipeline-engine bf16 wrapper, which a stage-0 data-parallel
engine never returns. Stage 0 in fp32 returns no wrapper at all (``initialize.py``).

They cannot be constructed: the stage objects are built by ``deepspeed.initialize``.
"""

from __future__ import annotations

from abc import ABCMeta

import torch


def _stage_objects() -> tuple[type, ...]:
    # Imported on use: these modules import torch.distributed and the ops.
    from .moe_stage import ExpertParallelZeroStage
    from .partitioned_optimizer import ZeroPartitionedOptimizer
    from .stage3 import ZeroStage3

    return ZeroPartitionedOptimizer, ExpertParallelZeroStage, ZeroStage3


def _stage_of(obj) -> int | None:
    partitioned, expert_parallel, stage3 = _stage_objects()
    if isinstance(obj, stage3):
        return 3
    if isinstance(obj, (partitioned, expert_parallel)):
        return getattr(obj, "stage", None)
    return None


def _param_dtypes(obj) -> set[torch.dtype]:
    return {p.dtype for p in getattr(obj, "params", ())}


def _steps_with_fused_adam(obj) -> bool:
    from ...optim import FusedAdam

    return isinstance(getattr(obj, "optimizer", None), FusedAdam)


class _ConfigurationKind(ABCMeta):
    """``isinstance(x, cls)`` is ``cls._matches(x)`` for the stage objects, else the usual."""

    def __instancecheck__(cls, obj) -> bool:
        if _stage_of(obj) is not None:
            return cls._matches(obj)
        return super().__instancecheck__(obj)


class _OptimizerKind(metaclass=_ConfigurationKind):
    def __new__(cls, *args, **kwargs):
        raise TypeError(
            f"{cls.__name__} is the class name of what deepspeed.initialize returns, for "
            "isinstance(); it is built by deepspeed.initialize(model=..., config=...), not directly"
        )

    @classmethod
    def _matches(cls, obj) -> bool:
        return False


class DeepSpeedZeroOptimizer(_OptimizerKind):
    """The optimizer of a ZeRO stage 1 or 2 engine."""

    @classmethod
    def _matches(cls, obj) -> bool:
        return _stage_of(obj) in (1, 2)


class DeepSpeedZeroOptimizer_Stage3(_OptimizerKind):  # noqa: N801 - DeepSpeed's name
    """The optimizer of a ZeRO stage 3 engine."""

    @classmethod
    def _matches(cls, obj) -> bool:
        return _stage_of(obj) == 3


def _stage0_low_precision(obj) -> bool:
    """Stage 0 with fp16 (a loss scaler) or bf16 parameters: DeepSpeed's fp16 wrappers."""
    if _stage_of(obj) != 0:
        return False
    return getattr(obj, "loss_scaler", None) is not None or torch.bfloat16 in _param_dtypes(obj)


class BF16_Optimizer(_OptimizerKind):  # noqa: N801 - DeepSpeed's name
    """DeepSpeed's bf16 wrapper of its pipeline engine (and of bf16 ZeRO-1 with fp32 gradient
    accumulation); a data-parallel stage-0 engine's optimizer is not one."""

    @classmethod
    def _matches(cls, obj) -> bool:
        return False


class FP16_Optimizer(_OptimizerKind):  # noqa: N801 - DeepSpeed's name
    """The optimizer of an fp16 or bf16 engine without ZeRO that steps with FusedAdam."""

    @classmethod
    def _matches(cls, obj) -> bool:
        return _stage0_low_precision(obj) and _steps_with_fused_adam(obj)


class FP16_UnfusedOptimizer(_OptimizerKind):  # noqa: N801 - DeepSpeed's name
    """The optimizer of an fp16 or bf16 engine without ZeRO that steps with anything else."""

    @classmethod
    def _matches(cls, obj) -> bool:
        return _stage0_low_precision(obj) and not _steps_with_fused_adam(obj)
