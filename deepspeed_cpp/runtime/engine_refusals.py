"""What the engine refuses to build (named errors) and the clean-up of a model's previous engine,
kept apart from the engine so that its constructor reads as the steps it takes."""

from __future__ import annotations

import torch

from ..utils.logging import logger
from .config import DeepSpeedConfig
from .config.deepspeed_config import offload_param_needs_offload_optimizer
from .config.errors import DeepSpeedConfigError


def release_previous_engine(model: torch.nn.Module) -> None:
    """A model handed to a second engine must not keep the first one's hooks."""
    engine_ref = getattr(model, "_deepspeed_cpp_engine", None)
    previous = engine_ref() if engine_ref is not None else None
    if previous is not None:
        logger.info("deepspeed_cpp: the model had an engine; destroying its hooks first")
        previous.destroy()


def refuse_param_offload_alone(optimizer, param_offload, optimizer_offload) -> None:
    """ZeRO-3 ``offload_param`` steps its fp32 masters on the host, so with an optimizer it needs
    ``offload_optimizer`` too. The config refuses that when it names an optimizer; a client
    optimizer given to initialize() is only known here. Without one (ZeRO Inference) it is
    fine."""
    if optimizer is not None and param_offload is not None and optimizer_offload is None:
        message = offload_param_needs_offload_optimizer(param_offload.device)
        raise DeepSpeedConfigError([message], "initialize()")


def refuse_expert_parallel_with(config: DeepSpeedConfig, mp_world_size: int) -> None:
    """Expert-parallel (ep_size > 1) MoE trains at ZeRO stages 0-2 (1-2 with offload_optimizer):
    ZeRO-3 partitions every parameter over one group. Its groups span the world: not yet
    combined with model parallelism."""
    if mp_world_size > 1:
        raise NotImplementedError(
            "deepspeed_cpp.initialize: expert-parallel MoE layers (ep_size > 1) with an mpu of "
            f"model-parallel size {mp_world_size} are not supported yet; use ep_size=1 or no mpu"
        )
    zero = config.zero_optimization
    if zero.stage == 3:
        raise NotImplementedError(
            "deepspeed_cpp.initialize: zero_optimization.stage 3 with expert-parallel MoE layers "
            "(ep_size > 1) is not supported; use stage 0, 1 or 2 (offload_optimizer works at 1 "
            "and 2), or ep_size=1"
        )


def refuse_partitioned_parameters(model: torch.nn.Module, stage: int) -> None:
    for name, param in model.named_parameters():
        if hasattr(param, "ds_id") and not param.ds_persist:
            raise ValueError(
                f"parameter '{name}' is partitioned by ZeRO-3 (built under zero.Init or by a "
                f"ZeRO-3 engine) but the config asks for ZeRO stage {stage}; use stage 3, or "
                f"build the model outside zero.Init"
            )


def refuse_zero3_with_model_parallelism(config: DeepSpeedConfig, mp_world_size: int) -> None:
    """ZeRO-3 partitions every parameter over one group; with model parallelism (an mpu of
    model-parallel size > 1) it is not supported (DeepSpeed supports it only in part)."""
    if mp_world_size > 1 and config.zero_optimization.stage == 3:
        raise NotImplementedError(
            "deepspeed_cpp.initialize: zero_optimization.stage 3 with an mpu of model-parallel "
            f"size {mp_world_size} is not supported; use stage 0, 1 or 2 (gradients are reduced "
            "over the mpu's data-parallel group), or no mpu"
        )
