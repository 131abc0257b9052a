"""DeepSpeed's MoE helpers for building optimizer parameter groups.

Expert parameters are recognised as DeepSpeed marks them (``param.allreduce is False``, with a
``group_name`` of ``"ep_size_<n>"``). The engine reduces the gradients of ep_size > 1 experts over
their expert-data-parallel group (``runtime/zero/moe_stage.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .layer import MoE

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
    of new dicts (the input is not modified; generators are consumed once): first every input
    group with its expert parameters taken out, in order; then, as DeepSpeed does, for each input
    group and each expert group name (``param.group_name``, in order of first appearance), groups
    holding that group's expert parameters of that name, with the input group's options,
    ``"name"`` set to the expert group name and ``"moe": True``; each at most ``max_group_size``
    elements (a larger parameter gets a group of its own; ``None``: no limit).
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
    shared_groups = []
    expert_groups = []
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
        by_name: dict[str, list[torch.Tensor]] = {}
        shared = []
        for param_index, param in enumerate(params):
            if not is_moe_param(param):
                shared.append(param)
                continue
            name = getattr(param, "group_name", None)
            if not isinstance(name, str):
                raise ValueError(
                    f"{where} params[{param_index}] of shape {tuple(param.shape)} is an expert "
                    f"parameter (allreduce=False) without a group_name (got {name!r}); expert "
                    "parameters carry group_name='ep_size_<n>' (set by the MoE layer)"
                )
            by_name.setdefault(name, []).append(param)
        shared_groups.append({**group, "params": shared})
        options = {key: value for key, value in group.items() if key not in ("params", "name")}
        for name, members in by_name.items():
            for chunk in _chunks_of_at_most(members, max_group_size):
                expert_groups.append({**options, "name": name, "moe": True, "params": chunk})
    return shared_groups + expert_groups


def _chunks_of_at_most(params: list[torch.Tensor], max_numel: int | None):
    """Consecutive runs of ``params`` of at most ``max_numel`` elements each (DeepSpeed's
    greedy split; a parameter larger than the limit is a run of its own)."""
    if max_numel is None:
        yield params
        return
    run, size = [], 0
    for param in params:
        if run and size + param.numel() > max_numel:
            yield run
            run, size = [], 0
        run.append(param)
        size += param.numel()
    if run:
        yield run
