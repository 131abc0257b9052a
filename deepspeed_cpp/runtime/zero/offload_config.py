"""DeepSpeed's ``deepspeed.runtime.zero.offload_config`` names for our offload config sections.

``DeepSpeedZeroOffloadParamConfig`` / ``DeepSpeedZeroOffloadOptimizerConfig`` are the very
classes the config parses ``offload_param`` / ``offload_optimizer`` into (``config/sections.py``),
so ``engine.config.zero_optimization.offload_optimizer`` is an instance of them.
``OffloadDeviceEnum`` is a ``str`` enum: ``config.device == OffloadDeviceEnum.cpu`` holds for the
plain ``"cpu"`` the config stores, as it does in DeepSpeed.
"""

from __future__ import annotations

from enum import Enum

from ..config.sections import OffloadOptimizerConfig, OffloadParamConfig

DeepSpeedZeroOffloadParamConfig = OffloadParamConfig
DeepSpeedZeroOffloadOptimizerConfig = OffloadOptimizerConfig


class OffloadDeviceEnum(str, Enum):
    """Where offloaded state lives (``zero_optimization.offload_*.device``)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """The engine states ``engine.offload_states(include=...)`` can move."""

    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"


__all__ = [
    "DeepSpeedZeroOffloadOptimizerConfig",
    "DeepSpeedZeroOffloadParamConfig",
    "OffloadDeviceEnum",
    "OffloadStateTypeEnum",
]
