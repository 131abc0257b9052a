"""``build_stage``: the ZeRO stage of a config, over a module, with the optimizer a user passed
to ``initialize`` (or the config's), in one place, so the engine holds no stage construction.

Stages 0-2 are a ``ZeroPartitionedOptimizer`` over flat buckets (an ``ExpertParallelZeroStage``
of several, where MoE experts need sets of their own), stage 3 a ``ZeroStage3`` holding one over
ZeRO-3's partitioned buckets (``partitioned_buckets.py``), its parameter coordinator and its
parameter home; each ``ZeroPartitionedOptimizer`` (its ``ShardSet``, reducer and stepper) is built
by ``shard_set_builder.build_zero_stage`` with the same settings from the config (bucket size,
clipping, loss scaler, offload). ``None``: no optimizer anywhere, so nothing to train (inference
or evaluation; a stage-3 model is still partitioned and gathered).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from ...utils.logging import logger
from ..call_order import refuse_foreign_parameters
from ..config.deepspeed_config import offload_param_needs_offload_optimizer
from ..config.errors import DeepSpeedConfigError
from ..config_optimizer import client_optimizer_wins, config_optimizer_factory
from . import partition_parameters as pp
from .moe_stage import build_expert_parallel_stage
from .offload.optimizer_offload import OptimizerOffload, ParamOffload
from .partitioned_optimizer import ZeroPartitionedOptimizer
from .shard_set_builder import FlatBuckets, build_zero_stage
from .unused_parameters import UnusedParameterCheck
from .utils import ZeRORuntimeException


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
    parallel=None,
):
    """The ``ZeroStage`` for ``config.zero_optimization.stage`` over ``module`` on ``group``.

    ``optimizer``: what the user passed to ``initialize`` (a torch optimizer over the module's
    parameters, a callable building one from param groups, or None for the config's);
    ``model_parameters``: ``initialize``'s (parameters, named parameters or param-group dicts;
    None: the module's). An optimizer passed to ``initialize`` wins over the config's section,
    as in DeepSpeed. ``parallel`` (``runtime/model_parallel.py``'s ``ModelParallelGroups``):
    with model parallelism, stages 0-2 take the gradient norm over the whole model."""
    config_optimizer = config.optimizer
    if optimizer is not None:
        config_optimizer = client_optimizer_wins(config_optimizer, dist.get_rank())
    zero = config.zero_optimization
    offload = OptimizerOffload.from_config(zero, config.aio, config.step_during_backward_setting())
    if offload is not None and config.zero_force_ds_cpu_optimizer:
        optimizer = _only_cpu_optimizers(optimizer)
    # Offloaded master shards are stepped on the host: the config optimizer is a CPU one.
    optimizer_device = device if offload is None else torch.device("cpu")
    common = dict(
        group=group,
        gradient_clipping=config.gradient_clipping,
        loss_scaler=loss_scaler,
        offload=offload,
    )
    # With a partial offload (ratio < 1), the optimizer of the part left on the device.
    device_part = _device_part_optimizer(config_optimizer, offload, device)
    if zero.stage == 3:
        return _build_stage3(
            config,
            config_optimizer,
            module,
            optimizer,
            device,
            optimizer_device,
            model_parameters,
            dict(common, device_optimizer=device_part),
        )
    common.update(
        stage=zero.stage,
        reduce_bucket_size=int(zero.reduce_bucket_size),
        reduce_scatter=zero.reduce_scatter,
    )
    if parallel is not None and parallel.mp_world_size > 1:
        common.update(norm_group=parallel.mp_group, counts_in_norm=parallel.counts_in_norm)
    make_stage = partial(build_zero_stage, layout=FlatBuckets())
    if expert_parallel:
        # Expert parameters of ep_size > 1 get sets of their own, each reduced and sharded over
        # its expert-data-parallel group, offloaded to a home of its own (a partial offload,
        # which needs a device optimizer, is refused there).
        make_stage = build_expert_parallel_stage
    else:
        common["device_optimizer"] = device_part
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
            optimizer = optimizer(param_groups_of(module, model_parameters))
        check_optimizer_covers_module(module, optimizer)
        return _checking_unused(make_stage(optimizer, **common), zero, offload)
    if config_optimizer is None:
        return None  # inference or evaluation only; step() will say so
    factory = config_optimizer_factory(
        config_optimizer.type,
        config_optimizer.params,
        optimizer_device,
        offloaded=offload is not None,
    )
    stage = make_stage(factory, param_groups_of(module, model_parameters), **common)
    return _checking_unused(stage, zero, offload)


def _checking_unused(stage, zero, offload):
    """``ignore_unused_parameters = false`` where DeepSpeed checks it: ZeRO 1/2 offloaded to the
    host (``unused_parameters.py``); elsewhere DeepSpeed lets unused parameters through too."""
    if not zero.ignore_unused_parameters and zero.stage in (1, 2) and offload is not None:
        if isinstance(stage, ZeroPartitionedOptimizer):
            stage.unused_parameter_check = UnusedParameterCheck(stage.params)
    return stage


def _build_stage3(
    config, config_optimizer, module, optimizer, device, optimizer_device, model_parameters, common
):
    """Partitions ``module``'s parameters (adopting them into their offload home), hooks the
    parameter coordinator in, then builds the optimizer over the shards; a failure leaves no
    hooks on the model and puts adopted shards back on the device."""
    from .coordinator import ParameterCoordinator
    from .partitioned_buckets import PartitionedBuckets
    from .stage3 import ZeroStage3, partition_module

    if isinstance(optimizer, torch.optim.Optimizer):
        check_optimizer_covers_module(module, optimizer)
    if optimizer is None and config_optimizer is not None:
        optimizer = config_optimizer_factory(
            config_optimizer.type,
            config_optimizer.params,
            optimizer_device,
            offloaded=common["offload"] is not None,
        )
    zero = config.zero_optimization
    param_offload = ParamOffload.from_config(zero, config.aio)
    param_offload = _host_offload_on_host(param_offload, optimizer, common["offload"], device)
    refuse_param_offload_alone(optimizer, param_offload, common["offload"])
    dtype = (
        torch.float16 if config.fp16.enabled else torch.bfloat16 if config.bf16.enabled else None
    )
    param_groups = param_groups_of(module, model_parameters) if optimizer is not None else None
    group = common["group"]
    partition_module(
        module,
        group,
        device=device,
        dtype=dtype,
        param_threshold=int(zero.param_persistence_threshold),
        model_threshold=int(zero.model_persistence_threshold),
    )
    param_home = None
    if param_offload is not None:
        param_home = param_offload.make_home(device, rank=dist.get_rank(group))
        adopted = [
            p
            for p in module.parameters()
            if pp.is_partitioned(p) and getattr(p, "ds_home", None) is None
        ]
        try:
            param_home.check_fits(adopted)
            for param in adopted:
                param_home.adopt(param)
        except BaseException:
            param_home.close()  # shards adopted so far go back to the device
            raise
    coordinator = ParameterCoordinator(
        module,
        group,
        prefetch_bucket_size=zero.prefetch_bucket_size,
        max_live_parameters=zero.max_live_parameters,
        max_reuse_distance=zero.max_reuse_distance,
        unit_min_numel=zero.unit_min_numel,
    )
    if optimizer is None:
        return ZeroStage3(group, coordinator, None, param_home)
    offload = common["offload"]
    # step_during_backward steps a sub-group once its unit's gradients are reduced: units
    # sharing one reduction would hold every step back to the end of backward. Decided before
    # the optimizer exists, so "maybe" (None) counts.
    layout = PartitionedBuckets(
        model_order={id(p): i for i, p in enumerate(module.parameters())},
        unit_of_param=coordinator.unit_of_param(),
        units_reduced_apart=offload is not None and offload.step_during_backward is not False,
    )
    try:
        partitioned = build_zero_stage(
            optimizer,
            param_groups,
            layout=layout,
            stage=3,
            reduce_bucket_size=int(zero.reduce_bucket_size),
            reduce_scatter=zero.reduce_scatter,
            **common,
        )
        # One Python hook per partitioned parameter: the coordinator's, which hands the
        # gradient to the stage before counting its unit down.
        coordinator.hand_gradients_to(
            partitioned.take_over_grad_hooks(coordinator.params_with_grad_hooks())
        )
    except BaseException:
        coordinator.destroy()  # no hooks left behind on the model
        if param_home is not None:
            param_home.close()
        raise
    return ZeroStage3(group, coordinator, partitioned, param_home)


def _refuse_unless_cpu_optimizer(optimizer):
    from ...optim import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam, DeepSpeedCPULion

    if not isinstance(optimizer, (DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion)):
        raise ZeRORuntimeException(
            f"zero_optimization.offload_optimizer with an optimizer passed to initialize() "
            f"({type(optimizer).__name__}) that is not a CPU optimizer: it would step the "
            f"host's shards slowly. Use deepspeed.ops.adam.DeepSpeedCPUAdam (or -Adagrad, "
            f"-Lion), the config's 'optimizer' section, or set \"zero_force_ds_cpu_optimizer\": "
            f"false to run it anyway (DeepSpeed refuses it the same way)"
        )
    return optimizer


def _only_cpu_optimizers(optimizer):
    """DeepSpeed's ``zero_force_ds_cpu_optimizer`` (on by default): with optimizer offload, a
    client optimizer must be a CPU one; a callable is checked on what it builds."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, torch.optim.Optimizer) and callable(optimizer):
        return lambda groups: _refuse_unless_cpu_optimizer(optimizer(groups))
    return _refuse_unless_cpu_optimizer(optimizer)


def _device_part_optimizer(config_optimizer, offload, device):
    """With a partial offload (``ratio`` < 1), the config optimizer for the device's part."""
    if offload is None or offload.ratio >= 1.0 or config_optimizer is None:
        return None
    return config_optimizer_factory(config_optimizer.type, config_optimizer.params, device)


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


def _host_offload_on_host(param_offload, optimizer, optimizer_offload, device):
    """DeepSpeed's ``offload_param: cpu`` without ``offload_optimizer`` keeps the parameter
    shards in host memory and steps the masters on the device. On a CPU device both are host
    memory already: the stage runs without a parameter home, stepping where it always does (a
    GPU device still needs offload_optimizer here, ``refuse_param_offload_alone``)."""
    alone = optimizer is not None and optimizer_offload is None
    if param_offload is None or not alone or param_offload.device != "cpu":
        return param_offload
    if device.type != "cpu":
        return param_offload
    if dist.get_rank() == 0:
        logger.info(
            "zero_optimization.offload_param.device 'cpu' without offload_optimizer on a CPU "
            "device: the parameter shards already live in host memory; nothing more to offload"
        )
    return None


def refuse_param_offload_alone(optimizer, param_offload, optimizer_offload) -> None:
    """ZeRO-3 ``offload_param`` steps its fp32 masters on the host, so with an optimizer it needs
    ``offload_optimizer`` too. The config refuses that when it names an optimizer; a client
    optimizer given to initialize() is only known here. Without one (ZeRO Inference) it is
    fine."""
    if optimizer is not None and param_offload is not None and optimizer_offload is None:
        message = offload_param_needs_offload_optimizer(param_offload.device)
        raise DeepSpeedConfigError([message], "initialize()")
