"""What every ZeRO stage object sets up first, shared by ``ZeroPartitionedOptimizer`` (built by
``shard_set_builder.py``) and the expert-parallel composite (``moe_stage.py``): which param
groups it trains, the fields the engine reads (stage, group, world size, rank, clipping, loss
scaler, counters), and the torch optimizer over the fp32 master shards once they exist."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

OptimizerOrFactory = torch.optim.Optimizer | Callable[[list[dict]], torch.optim.Optimizer]


def trained_param_groups(
    optimizer: OptimizerOrFactory, param_groups: list[dict] | None
) -> list[dict]:
    """The param groups a stage trains: the user's optimizer's, or ``param_groups`` when
    ``optimizer`` is a factory (then required)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.param_groups
    if param_groups is None:
        raise ValueError("param_groups is required when optimizer is a factory")
    return param_groups


def set_stage_fields(
    stage_object,
    *,
    stage: int,
    group: dist.ProcessGroup,
    gradient_clipping: float,
    loss_scaler,
) -> None:
    """Sets the fields the engine reads on ``stage_object`` (see the module docstring)."""
    stage_object.stage = stage
    stage_object.group = group
    stage_object.world_size = dist.get_world_size(group)
    stage_object.rank = dist.get_rank(group)
    stage_object.gradient_clipping = float(gradient_clipping)
    stage_object.loss_scaler = loss_scaler
    stage_object.global_grad_norm = None
    stage_object.skipped_steps = 0
    # Whether the last step was skipped for an fp16 overflow (the engine sets it after each
    # step): DeepSpeed's name on its ZeRO optimizers, which accelerate reads to tell the Trainer.
    stage_object.overflow = False


def optimizer_over_masters(
    optimizer: OptimizerOrFactory, master_groups: list[dict]
) -> torch.optim.Optimizer:
    """The torch optimizer stepping ``master_groups`` (one per param group, in order): the
    user's object with its groups re-pointed at the masters and its state emptied (schedulers
    and code holding it keep working), or a new one from the factory."""
    if isinstance(optimizer, torch.optim.Optimizer):
        for param_group, master_group in zip(optimizer.param_groups, master_groups):
            param_group["params"] = master_group["params"]
        optimizer.state.clear()
        return optimizer
    return optimizer(master_groups)
