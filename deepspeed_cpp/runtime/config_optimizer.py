"""The optimizer named by the ds_config ``optimizer`` section, built over given param groups, and
which of it and an optimizer passed to initialize() wins."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.fused_adam import fused_adam_available
from ..optim import DeepSpeedCPUAdam, DeepSpeedCPULion, FusedAdam
from ..utils.logging import logger


def config_optimizer_factory(
    optimizer_type: str, params: dict, device: torch.device, *, offloaded: bool = False
) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """A function building the configured optimizer over param groups (of fp32 master shards).

    Adam/AdamW: DeepSpeed's ``adam_w_mode`` (default true: "Adam" with weight decay is AdamW)
    and ``torch_adam`` are honoured. The class is the one DeepSpeed 0.19.8 builds, so that
    ``isinstance`` on ``engine.optimizer.optimizer`` answers the same: ``DeepSpeedCPUAdam`` for
    ``offloaded`` master shards (``offload_optimizer``), else ``FusedAdam`` (DeepSpeed's CPU
    accelerator builds FusedAdam too). On the CPU both step in ``cpu_adam``, bit for bit alike;
    on CUDA ``FusedAdam`` runs the multi-tensor op when it can, else torch's fused Adam/AdamW
    steps. SGD is torch's.
    """
    kind = optimizer_type.lower()
    params = dict(params)
    if kind in ("adam", "adamw"):
        adamw_mode = kind == "adamw" or bool(params.pop("adam_w_mode", True))
        torch_adam = bool(params.pop("torch_adam", False))
        hyper = dict(
            lr=params.pop("lr", 1e-3),
            betas=tuple(params.pop("betas", (0.9, 0.999))),
            eps=params.pop("eps", 1e-8),
            weight_decay=params.pop("weight_decay", 0.0),
        )
        bias_correction = bool(params.pop("bias_correction", True))
        if device.type == "cpu" and not torch_adam and offloaded:
            return lambda groups: DeepSpeedCPUAdam(
                groups, adamw_mode=adamw_mode, bias_correction=bias_correction, **hyper
            )
        on_cpu = device.type == "cpu"
        if not torch_adam and (on_cpu or (device.type == "cuda" and fused_adam_available()[0])):
            return lambda groups: FusedAdam(
                groups, adam_w_mode=adamw_mode, bias_correction=bias_correction, **hyper
            )
        if not bias_correction:
            raise ValueError(
                "optimizer.params.bias_correction=false needs the CPU Adam (set torch_adam to "
                "false on CPU); torch's Adam always corrects bias"
            )
        torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        fused = device.type == "cuda"
        return lambda groups: torch_class(groups, fused=fused or None, **hyper)
    if kind == "lion":
        hyper = dict(lr=params.pop("lr", 1e-3), betas=tuple(params.pop("betas", (0.9, 0.999))),
                     weight_decay=params.pop("weight_decay", 0.0))  # fmt: skip
        if device.type != "cpu":
            raise ValueError(
                f"optimizer.type 'Lion' on {device.type} is not supported yet (DeepSpeed's "
                "FusedLion has no counterpart here); it runs on the CPU, or with "
                "zero_optimization.offload_optimizer"
            )
        return lambda groups: DeepSpeedCPULion(groups, **hyper)
    if kind == "sgd":
        hyper = {k: params[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov")
                 if k in params}  # fmt: skip
        return lambda groups: torch.optim.SGD(groups, **hyper)
    raise ValueError(
        f"optimizer.type '{optimizer_type}' is not supported yet; supported: Adam, AdamW, Lion, SGD"
    )


def client_optimizer_wins(config_optimizer, rank: int) -> None:
    """An optimizer passed to initialize() is the one trained with, as in DeepSpeed (whose
    initialize() documents that it "overrides any optimizer definition in the DeepSpeed json
    config"); the config's section is then ignored, which rank 0 says."""
    if rank == 0:
        logger.info("Using client Optimizer as basic optimizer")
        if config_optimizer is not None:
            logger.warning(
                "deepspeed_cpp: the config's 'optimizer' section (type %r) is ignored: an "
                "optimizer was passed to initialize() and is used instead",
                config_optimizer.type,
            )
    return None
