"""``param.ds_summary()``: DeepSpeed's one-dict description of a ZeRO-3 parameter.

Users print it when debugging ZeRO-3 (and DeepSpeed's own tests put it in assertion messages), so
it has DeepSpeed's keys. One difference in meaning: DeepSpeed records the ids of the submodules
holding a gathered parameter; deepspeed_cpp counts its holders (a module, ``GatheredParameters``,
a tied use), so ``active_sub_modules`` is that count.
"""

from __future__ import annotations

import types

import torch


def ds_summary(param: torch.Tensor, use_debug_name: bool = False) -> dict:
    """The parameter's ZeRO-3 state; ``use_debug_name`` names it (once an engine has seen the
    model) instead of giving its ``ds_id``."""
    name = getattr(param, "ds_name", None)
    shard = param.ds_tensor
    return {
        "id": f"name={name} id={param.ds_id}" if use_debug_name else param.ds_id,
        "status": param.ds_status.name,
        "numel": param.numel(),
        "ds_numel": param.ds_numel,
        "shape": tuple(param.shape),
        "ds_shape": tuple(param.ds_shape),
        "requires_grad": param.requires_grad,
        "grad_shape": tuple(param.grad.shape) if param.grad is not None else None,
        "persist": param.ds_persist,
        "active_sub_modules": param.ds_active,
        "ds_tensor.shape": shard.shape if shard is not None else None,
    }


def attach_summary(param: torch.Tensor) -> None:
    """Gives ``param`` its ``ds_summary()`` method, as DeepSpeed's partitioned parameters have."""
    param.ds_summary = types.MethodType(ds_summary, param)
