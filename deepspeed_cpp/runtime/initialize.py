"""``deepspeed_cpp.initialize`` and ``add_config_arguments``: DeepSpeed's entry points."""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from ..comm import init_distributed
from ..comm.exit_grace import release_gil_at_exit
from .activation_checkpointing.checkpointing import (
    configure_from_config as configure_activation_checkpointing,
)
from .config import DeepSpeedConfig
from .engine import DeepSpeedEngine
from .model_parallel import check_mpu
from .model_parallel import register as register_mpu
from .rank_consistency import check_ranks_agree, report_setup_failure
from .tensor_parallel.setup import mpu_for
from .zero.zero_init import paused as zero_init_paused


def initialize(
    args=None,
    model=None,
    optimizer=None,
    model_parameters=None,
    training_data=None,
    lr_scheduler=None,
    distributed_port: int | None = None,
    mpu=None,
    dist_init_required: bool | None = None,
    collate_fn=None,
    config=None,
    config_params=None,
    mesh_param=None,
):
    """Builds the training engine; returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)`` as DeepSpeed does.

    The config is ``config`` (a path or a dict; ``config_params`` is its older name) or
    ``args.deepspeed_config``. The process group is created if needed (torchrun's environment,
    or a world of one). ``mpu`` (DeepSpeed's model-parallel unit, ``get_{data,model}_parallel_
    {group,rank,world_size}()``) makes ZeRO 0-2 train over its data-parallel group with the
    gradient norm taken over the whole model (``model_parallel.py``); the config's
    ``tensor_parallel.autotp_size`` builds such an mpu and splits the model over its
    tensor-parallel groups (``tensor_parallel/setup.py``); ``mesh_param`` is not supported yet.
    """
    if mesh_param is not None:
        raise NotImplementedError(
            "initialize(mesh_param=...): sequence parallelism over a device mesh is not "
            "supported yet; pass mpu=... for model parallelism"
        )
    if config is None:
        config = config_params
    if config is not None and getattr(args, "deepspeed_config", None) is not None:
        raise ValueError(
            "the config was given twice: initialize(config=...) and args.deepspeed_config "
            f"({args.deepspeed_config!r}); keep one"
        )
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    release_gil_at_exit()  # the engine's collectives must not abort the process at its exit
    from .pipe.module import PipelineModule

    pipeline = isinstance(model, PipelineModule)
    if pipeline and mpu is None:
        # A pipeline's grid is its mpu: replicas of a stage form the data-parallel group, the
        # stages of one replica the model-parallel group (the whole-model gradient norm).
        mpu = model.mpu()
    # Before the engine's first collective, the ranks agree that they set up the same training
    # (rank_consistency.py); a rank whose config fails to load tells the others so.
    try:
        if mpu is not None:
            check_mpu(mpu)
        read = DeepSpeedConfig.read(config=config, args=args)
        # The batch-size rule counts the data-parallel replicas of a caller's mpu. AutoTP without
        # one (tensor_parallel.autotp_size, or a model split by tp_model_init) counts every rank,
        # as DeepSpeed 0.19.8 does (and transformers' "auto" fill: world x micro x accumulation).
        dp_world_size = mpu.get_data_parallel_world_size() if mpu is not None else None
        mpu = mpu_for(model, int(read.tensor_parallel.autotp_size), mpu)  # the TP x DP groups
        ds_config = read.finalize(dp_world_size or dist.get_world_size())
    except Exception as error:
        report_setup_failure(error, args=args)
        raise
    check_ranks_agree(
        ds_config,
        model,
        # A pipeline's stages optimize other parameters (its model is compared per stage).
        optimizer=None if pipeline else optimizer,
        model_parameters=None if pipeline else model_parameters,
        lr_scheduler=lr_scheduler,
        args=args,
        model_group=mpu.get_data_parallel_group() if mpu is not None else None,
    )
    # deepspeed_cpp.utils.groups answers from this engine's mpu (as DeepSpeed's does); None
    # forgets an earlier engine's, whose groups no longer describe this one.
    register_mpu(mpu)
    if ds_config.activation_checkpointing is not None:
        configure_activation_checkpointing(ds_config.activation_checkpointing, mpu)
    engine_class = DeepSpeedEngine
    if pipeline:
        from .pipe.engine import PipelineEngine

        engine_class = PipelineEngine
    with zero_init_paused():  # initialize() inside a zero.Init block, as DeepSpeed allows
        engine = engine_class(
            args=args,
            model=model,
            optimizer=optimizer,
            model_parameters=model_parameters,
            training_data=training_data,
            lr_scheduler=lr_scheduler,
            config=ds_config,
            collate_fn=collate_fn,
            mpu=mpu,
        )
    return engine, handed_back_optimizer(engine), engine.training_dataloader, engine.lr_scheduler


def handed_back_optimizer(engine):
    """The optimizer ``initialize`` returns, as DeepSpeed 0.19.8 chooses it.

    At ZeRO stage 0 without fp16/bf16 DeepSpeed wraps nothing: it returns the torch optimizer
    that steps (the client's own object, the one a callable built, or the config's FusedAdam),
    and scripts compare it with theirs (``ds_optimizer is client_optimizer``) or test its class.
    Ours steps that same object inside the stage-0 wrapper, whose hooks reduce the gradients
    during ``engine.backward`` (its ``.grad`` tensors are the reduced flat gradients) and whose
    ``step`` clips before calling it, so handing it back leaves the reduction in place;
    ``engine.optimizer`` stays the wrapper. Otherwise (stages 1-3, fp16/bf16) DeepSpeed returns
    its wrapper and so do we.
    """
    stage = engine.optimizer
    if stage is None or getattr(stage, "stage", None) != 0 or stage.loss_scaler is not None:
        return stage
    inner = getattr(stage, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        return stage  # the expert-parallel composite steps several
    if any(param.dtype != torch.float32 for param in getattr(stage, "params", ())):
        return stage  # bf16 at stage 0: DeepSpeed's FP16_UnfusedOptimizer / FP16_Optimizer
    return inner


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Adds DeepSpeed's command-line arguments: --deepspeed, --deepspeed_config."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (helper flag for user code, no impact on the engine)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file."
    )
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser
