"""DeepSpeed's ``deepspeed.runtime.zero.config`` names: ``DeepSpeedZeroConfig`` is the class the
``zero_optimization`` section parses into (``config/sections.ZeroConfig``); ``ZeroStageEnum``
names the stages. ``DeepSpeedZeroConfig(**section)`` validates a section as the engine would."""

from __future__ import annotations

from enum import Enum

from ..config.sections import ZeroConfig
from .offload_config import (
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
    OffloadDeviceEnum,
)

DeepSpeedZeroConfig = ZeroConfig


class ZeroStageEnum(int, Enum):
    """The ZeRO stages by what each partitions."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 3


__all__ = [
    "DeepSpeedZeroConfig",
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "ZeroStageEnum",
]
