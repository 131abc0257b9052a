"""DeepSpeed's optimizer wrapper class names, for ``isinstance`` on what ``initialize`` returns.

DeepSpeed hands back a different wrapper class per configuration (``DeepSpeedZeroOptimizer`` at
stages 1-2, ``DeepSpeedZeroOptimizer_Stage3`` at stage 3, ``BF16_Optimizer`` / ``FP16_Optimizer``
/ ``FP16_UnfusedOptimizer`` for low precision without ZeRO); scripts and DeepSpeed's tests test
for them with ``isinstance``. Ours is one stage object per stage, so each name here is a class
whose ``isinstance`` answers from the object's configuration: an engine's optimizer is an
instance of exactly the name DeepSpeed would have returned for the same config (the two fp16
names: an Adam-family optimizer is DeepSpeed's fused case, anything else its unfused one).

They cannot be constructed: the stage objects are built by ``deepspeed.initialize``.
"""

from __future__ import annotations

from abc import ABCMeta

import torch


def _stage_objects() -> tuple[type, ...]:
    # Imported on use: these modules import torch.distributed and the ops.
    from .moe_stage import ExpertParallelZeroStage
    from .partitioned_optimizer import ZeroPartitionedOptimizer
    from .stage3 import Stage3Optimizer, ZeroStage3

    return ZeroPartitionedOptimizer, ExpertParallelZeroStage, ZeroStage3, Stage3Optimizer


def _stage_of(obj) -> int | None:
    partitioned, expert_parallel, stage3, stage3_inner = _stage_objects()
    if isinstance(obj, (stage3, stage3_inner)):
        return 3
    if isinstance(obj, (partitioned, expert_parallel)):
        return getattr(obj, "stage", None)
    return None


def _param_dtypes(obj) -> set[torch.dtype]:
    return {p.dtype for p in getattr(obj, "params", ())}


def _is_adam_family(obj) -> bool:
    inner = getattr(obj, "optimizer", None)
    return inner is not None and "adam" in type(inner).__name__.lower()


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


def _stage0_in(obj, dtype: torch.dtype) -> bool:
    if _stage_of(obj) != 0:
        return False
    loss_scaler = getattr(obj, "loss_scaler", None)
    if dtype == torch.float16:
        return loss_scaler is not None
    return loss_scaler is None and dtype in _param_dtypes(obj)


class BF16_Optimizer(_OptimizerKind):  # noqa: N801 - DeepSpeed's name
    """The optimizer of a bf16 engine without ZeRO (stage 0)."""

    @classmethod
    def _matches(cls, obj) -> bool:
        return _stage0_in(obj, torch.bfloat16)


class FP16_Optimizer(_OptimizerKind):  # noqa: N801 - DeepSpeed's name
    """The optimizer of an fp16 engine without ZeRO whose optimizer is of the Adam family."""

    @classmethod
    def _matches(cls, obj) -> bool:
        return _stage0_in(obj, torch.float16) and _is_adam_family(obj)


class FP16_UnfusedOptimizer(_OptimizerKind):  # noqa: N801 - DeepSpeed's name
    """The optimizer of an fp16 engine without ZeRO whose optimizer is not an Adam."""

    @classmethod
    def _matches(cls, obj) -> bool:
        return _stage0_in(obj, torch.float16) and not _is_adam_family(obj)
