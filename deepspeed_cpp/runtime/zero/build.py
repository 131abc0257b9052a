"""``build_stage``: the ZeRO stage of a config, over a module, with the optimizer a user passed
to ``initialize`` (or the config's), in one place, so the engine holds no stage construction.

Stages 0-2 are a ``ZeroPartitionedOptimizer`` (an ``ExpertParallelZeroStage`` where MoE experts
need sets of their own), stage 3 a ``ZeroStage3``; every one gets the same settings from the
config (bucket size, clipping, loss scaler, offload). ``None``: no optimizer anywhere, so nothing
to train (inference or evaluation; a stage-3 model is still partitioned and gathered).
"""

from __future__ import annotations

import torch

from ..call_order import refuse_foreign_parameters
from ..config_optimizer import config_optimizer_factory
from .moe_stage import ExpertParallelZeroStage
from .offload.optimizer_offload import OptimizerOffload, ParamOffload
from .partitioned_optimizer import ZeroPartitionedOptimizer


def build_stage(
    config,
    module: torch.nn.Module,
    optimizer,
    group,
    device: torch.device,
    *,
    model_parameters=None,
    loss_scaler=None,
    expert_parallel: bool = False,
):
    """The ``ZeroStage`` for ``config.zero_optimization.stage`` over ``module`` on ``group``.

    ``optimizer``: what the user passed to ``initialize`` (a torch optimizer over the module's
    parameters, a callable building one from param groups, or None for the config's);
    ``model_parameters``: ``initialize``'s (parameters, named parameters or param-group dicts;
    None: the module's)."""
    if optimizer is not None and config.optimizer is not None:
        raise ValueError(
            "an optimizer was passed to initialize() and the config has an 'optimizer' "
            "section too; keep one of them"
        )
    zero = config.zero_optimization
    offload = OptimizerOffload.from_config(zero, config.aio, config.step_during_backward_setting())
    # Offloaded master shards are stepped on the host: the config optimizer is a CPU one.
    optimizer_device = device if offload is None else torch.device("cpu")
    common = dict(
        group=group,
        gradient_clipping=config.gradient_clipping,
        loss_scaler=loss_scaler,
        offload=offload,
        device_optimizer=_device_part_optimizer(config, offload, device),
    )
    if zero.stage == 3:
        return _build_stage3(
            config, module, optimizer, device, optimizer_device, model_parameters, common
        )
    common.update(
        stage=zero.stage,
        reduce_bucket_size=int(zero.reduce_bucket_size),
        reduce_scatter=zero.reduce_scatter,
    )
    stage_class = ZeroPartitionedOptimizer
    if expert_parallel:
        # Expert parameters of ep_size > 1 get sets of their own, each reduced and sharded over
        # its expert-data-parallel group, offloaded to a home of its own (a partial offload,
        # which needs a device optimizer, is refused there).
        stage_class = ExpertParallelZeroStage
        del common["device_optimizer"]
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
            optimizer = optimizer(param_groups_of(module, model_parameters))
        check_optimizer_covers_module(module, optimizer)
        return stage_class(optimizer, **common)
    if config.optimizer is None:
        return None  # inference or evaluation only; step() will say so
    factory = config_optimizer_factory(
        config.optimizer.type, config.optimizer.params, optimizer_device
    )
    return stage_class(factory, param_groups_of(module, model_parameters), **common)


def _build_stage3(config, module, optimizer, device, optimizer_device, model_parameters, common):
    from .stage3 import ZeroStage3

    if isinstance(optimizer, torch.optim.Optimizer):
        check_optimizer_covers_module(module, optimizer)
    if optimizer is None and config.optimizer is not None:
        optimizer = config_optimizer_factory(
            config.optimizer.type, config.optimizer.params, optimizer_device
        )
    dtype = (
        torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None
    )
    return ZeroStage3(
        module,
        optimizer,
        param_groups_of(module, model_parameters) if optimizer is not None else None,
        zero=config.zero_optimization,
        device=device,
        dtype=dtype,
        param_offload=ParamOffload.from_config(config.zero_optimization, config.aio),
        **common,
    )


def _device_part_optimizer(config, offload, device):
    """With a partial offload (``ratio`` < 1), the config optimizer for the device's part."""
    if offload is None or offload.ratio >= 1.0 or config.optimizer is None:
        return None
    return config_optimizer_factory(config.optimizer.type, config.optimizer.params, device)


def param_groups_of(module: torch.nn.Module, model_parameters) -> list[dict]:
    """``initialize``'s ``model_parameters`` as param-group dicts (None: the module's)."""
    if model_parameters is None:
        model_parameters = module.parameters()
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        groups = [dict(group, params=list(group["params"])) for group in items]
        for index, group in enumerate(groups):
            where = f"model_parameters[{index}]['params']"
            refuse_foreign_parameters(module, group["params"], where)
        return groups
    if items and isinstance(items[0], tuple):  # named_parameters()
        items = [param for _, param in items]
    refuse_foreign_parameters(module, items, "model_parameters")
    return [{"params": items}]


def check_optimizer_covers_module(module: torch.nn.Module, optimizer) -> None:
    for index, group in enumerate(optimizer.param_groups):
        where = f"the optimizer's param_groups[{index}]['params']"
        refuse_foreign_parameters(module, group["params"], where)
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, param in module.named_parameters():
        if param.requires_grad and id(param) not in in_optimizer:
            raise ValueError(
                f"parameter '{name}' (shape {tuple(param.shape)}) requires grad but is not in "
                f"the optimizer passed to initialize(); add it or set requires_grad=False"
            )


def refuse_expert_parallel_with(config) -> None:
    """Expert-parallel (ep_size > 1) MoE trains at ZeRO stages 0-2 (1-2 with offload_optimizer):
    ZeRO-3 partitions every parameter over one group."""
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
