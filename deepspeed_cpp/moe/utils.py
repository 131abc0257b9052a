"""DeepSpeed's MoE helpers for building optimizer parameter groups.

The engine does not yet average expert gradients over their expert-data-parallel group, so the
optimizer-group helper passes shared parameters through and refuses expert parameters
(recognised as DeepSpeed marks them: ``param.allreduce is False``, with a ``group_name``) by name
rather than let them be trained as if they were shared.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .layer import MoE

MOE_NOT_SUPPORTED = (
    "Mixture of Experts parameters cannot be trained through deepspeed_cpp's optimizer groups "
    "yet (expert-data-parallel gradient averaging is not implemented)"
)

DEFAULT_MAX_GROUP_SIZE = 178956971


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert parameter (DeepSpeed sets ``allreduce = False`` on them)."""
    return getattr(param, "allreduce", True) is False


def has_moe_layers(model: nn.Module) -> tuple[bool, int]:
    """``(True, num_experts)`` if ``model`` holds an MoE layer, else ``(False, 0)``."""
    for module in model.modules():
        if isinstance(module, MoE):
            return True, getattr(module, "num_experts", 0)
    return False, 0


def split_params_into_shared_and_expert_params(
    params: Iterable[nn.Parameter],
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(shared, expert)`` lists of ``params``, in their order."""
    shared, expert = [], []
    for param in params:
        (expert if is_moe_param(param) else shared).append(param)
    return shared, expert


def split_params_grads_into_shared_and_expert_params(
    group: Iterable[nn.Parameter],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(shared, expert)`` gradients (cast to the parameter dtype) of the params that have one."""
    shared, expert = [], []
    for param in group:
        if param.grad is not None:
            (expert if is_moe_param(param) else shared).append(param.grad.to(param.dtype))
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(
    param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
    max_group_size: int | None = DEFAULT_MAX_GROUP_SIZE,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups with the expert parameters split into groups of their own.

    Accepts one group (a dict with ``"params"``), or a list or tuple of them, and returns a list
    of groups, each a new dict whose ``"params"`` is a list (generators are consumed once). As
    deepspeed_cpp cannot yet train expert parameters, the result holds the same groups and
    parameters in the same order; a parameter marked as an expert's raises
    ``NotImplementedError`` naming its group and index.
    ``max_group_size`` (the size limit of the expert groups) is accepted for compatibility.
    """
    if isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, (list, tuple)):
        groups = list(param_groups)
    else:
        raise TypeError(
            "split_params_into_different_moe_groups_for_optimizer: param_groups is a "
            f"{type(param_groups).__name__}; expected a dict with 'params', or a list or tuple "
            "of such dicts"
        )
    result = []
    for group_index, group in enumerate(groups):
        where = f"split_params_into_different_moe_groups_for_optimizer: param_groups[{group_index}]"
        if not isinstance(group, dict):
            raise TypeError(
                f"{where} is a {type(group).__name__}; expected a dict like "
                "{'params': [...], 'name': ...}"
            )
        if "params" not in group:
            raise TypeError(f"{where} has keys {sorted(group)} but no 'params' entry")
        params = group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        for param_index, param in enumerate(params):
            if is_moe_param(param):
                raise NotImplementedError(
                    f"{MOE_NOT_SUPPORTED}: param_groups[{group_index}] "
                    f"(name={group.get('name')!r}) params[{param_index}] of shape "
                    f"{tuple(param.shape)} is an expert parameter "
                    f"(allreduce=False, group_name={getattr(param, 'group_name', None)!r})"
                )
        result.append({**group, "params": params})
    return result
