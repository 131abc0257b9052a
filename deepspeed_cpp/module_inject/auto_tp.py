"""Splits a model for tensor parallelism in place (``shard_model``) and puts its full weights
back together (``gather_full_state_dict``).

Every TP rank must start from the same whole model (the engine broadcasts it first) and keeps
its own slices; nothing else of the model changes: state-dict names stay the model's, and a
sliced parameter's full shape is its shape with ``partition_dim`` multiplied by the TP size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .layers import (
    LinearAllreduce,
    LinearLayer,
    is_tensor_parallel_param,
    mark_tensor_parallel,
    shard_tensor,
    unshard_tensors,
)
from .output_head import splits_output_head
from .tp_policies import TensorParallelPolicy, policy_for

# The attribute a split model carries: its TensorParallelInfo.
TP_INFO_ATTRIBUTE = "_deepspeed_cpp_tp"


@dataclass(frozen=True)
class TensorParallelInfo:
    group: object
    size: int
    rank: int
    split_modules: tuple[str, ...]


def shard_model(
    model: torch.nn.Module,
    group,
    *,
    policy: TensorParallelPolicy | None = None,
    partition_config: dict | None = None,
) -> TensorParallelInfo:
    """Replaces ``model``'s layers named by its policy with column-/row-parallel layers over
    ``group`` (this rank keeping its slices) and divides its attention modules' head counts."""
    existing = getattr(model, TP_INFO_ATTRIBUTE, None)
    if existing is not None:
        raise RuntimeError(
            f"the model is already split for tensor parallelism (size {existing.size}); "
            "split a model once"
        )
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    policy = policy if policy is not None else policy_for(model, partition_config)
    _check_heads_divide(model, policy, size)
    split = []
    for name, module in list(model.named_modules()):
        if not name:
            continue
        kind = policy.kind_of(name)
        gather_output = False
        if kind is None and policy.output_head and splits_output_head(model, name, module, size):
            kind, gather_output = "column", True
        if kind is not None:
            try:
                if kind == "column":
                    blocks = policy.blocks_of(name, module)
                    replacement = LinearLayer.from_module(
                        module, group, rank, size, blocks, gather_output=gather_output
                    )
                else:
                    replacement = LinearAllreduce.from_module(module, group, rank, size)
            except (TypeError, ValueError) as error:
                raise ValueError(f"tensor-parallel {kind} split of {name!r}: {error}") from None
            _set_submodule(model, name, replacement)
            split.append(name)
        elif any(re.fullmatch(p, name) for p in policy.head_split):
            _split_head_columns(name, module, rank, size)
            split.append(name)
    if not split:
        raise ValueError(
            f"the tensor-parallel policy matched no layer of {type(model).__name__} "
            f"(column patterns {list(policy.column)}, row patterns {list(policy.row)}): "
            "expected names like those of model.named_modules()"
        )
    _divide_head_attributes(model, policy, size)
    info = TensorParallelInfo(group, size, rank, tuple(split))
    setattr(model, TP_INFO_ATTRIBUTE, info)
    model.ds_autotp_parsed = True  # DeepSpeed's marker, read by integrations
    return info


def planned_slices(
    model: torch.nn.Module,
    size: int,
    *,
    policy: TensorParallelPolicy | None = None,
    partition_config: dict | None = None,
) -> dict[str, list[int]]:
    """What ``shard_model`` would split at TP ``size``, without splitting: {parameter name:
    [partition_dim, partition_stride]} as ``tensor_parallel_slices`` gives after the split
    (for comparing another library's split of the same, unsplit model)."""
    policy = policy if policy is not None else policy_for(model, partition_config)
    planned: dict[str, list[int]] = {}
    for name, module in model.named_modules():
        if not name:
            continue
        kind = policy.kind_of(name)
        if kind is None and policy.output_head and splits_output_head(model, name, module, size):
            kind = "column"
        if kind is not None:
            transposed = LinearLayer._layout_of(module)
            if kind == "column":
                blocks = policy.blocks_of(name, module)
                planned[f"{name}.weight"] = [1 if transposed else 0, blocks]
                if getattr(module, "bias", None) is not None:
                    planned[f"{name}.bias"] = [0, blocks]
            else:  # row: the input features; the bias is added once, whole
                planned[f"{name}.weight"] = [0 if transposed else 1, 1]
        elif any(re.fullmatch(p, name) for p in policy.head_split):
            planned[f"{name}.weight"] = [1, 1]
    return planned


def tensor_parallel_info(model: torch.nn.Module) -> TensorParallelInfo | None:
    return getattr(model, TP_INFO_ATTRIBUTE, None)


def _set_submodule(model: torch.nn.Module, name: str, replacement: torch.nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, replacement)


def _split_head_columns(name: str, module: torch.nn.Module, rank: int, size: int) -> None:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 2:
        raise ValueError(f"{name!r}: a per-head tensor to split must have a 2-d weight")
    try:
        columns = shard_tensor(weight.detach(), 1, rank, size)
    except ValueError as error:
        raise ValueError(f"tensor-parallel head split of {name!r}: {error}") from None
    piece = torch.nn.Parameter(columns, weight.requires_grad)
    mark_tensor_parallel(piece, 1)
    module.weight = piece
    if hasattr(module, "embedding_dim"):
        module.embedding_dim = piece.shape[1]


def _head_modules(model, policy):
    for name, module in model.named_modules():
        for class_pattern, attributes in policy.head_attributes.items():
            if re.fullmatch(class_pattern, type(module).__name__):
                for attribute in attributes:
                    value = getattr(module, attribute, None)
                    if isinstance(value, int) and not isinstance(value, bool):
                        yield name, module, attribute, value


def _check_heads_divide(model, policy, size: int) -> None:
    config = getattr(model, "config", None)
    for key in ("num_attention_heads", "num_key_value_heads", "num_heads", "n_head"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value % size != 0:
            raise ValueError(
                f"the tensor-parallel size {size} does not divide config.{key} = {value}: "
                "each rank must hold whole attention heads"
            )
    for name, _, attribute, value in _head_modules(model, policy):
        if value % size != 0:
            raise ValueError(
                f"the tensor-parallel size {size} does not divide {name}.{attribute} = {value}"
            )


def _divide_head_attributes(model, policy, size: int) -> None:
    for _, module, attribute, value in list(_head_modules(model, policy)):
        setattr(module, attribute, value // size)


def tensor_parallel_slices(module: torch.nn.Module) -> dict[str, list[int]]:
    """{parameter name: [partition_dim, partition_stride]} of every TP slice of ``module``
    (plain data for checkpoint metadata: what merging the parts needs, see unshard_tensors)."""
    return {
        name: [int(param.partition_dim), int(param.partition_stride)]
        for name, param in module.named_parameters(remove_duplicate=False)
        if is_tensor_parallel_param(param)
    }


def merge_tensor_parallel_parts(parts: list[dict], slices: dict[str, list[int]]) -> dict:
    """One unsplit state dict from the TP ranks' state dicts (in TP rank order): the names in
    ``slices`` concatenated by ``unshard_tensors``, the others (replicated) taken from rank 0."""
    merged = dict(parts[0])
    for name, (dim, stride) in slices.items():
        if name in merged:
            merged[name] = unshard_tensors([part[name] for part in parts], dim, stride)
    return merged


def gather_full_state_dict(module: torch.nn.Module, state_dict: dict) -> dict:
    """``state_dict`` (of ``module``, split for TP) with every TP slice replaced by the whole
    tensor, gathered over the TP group (a collective: every TP rank must call it)."""
    info = tensor_parallel_info(module)
    if info is None or info.size == 1:
        return state_dict
    by_id = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if is_tensor_parallel_param(param):
            by_id[name] = param
    full = dict(state_dict)
    for name in sorted(by_id):  # the same order on every rank
        if name not in state_dict:
            continue
        param, value = by_id[name], state_dict[name]
        slices = [torch.empty_like(value) for _ in range(info.size)]
        dist.all_gather(slices, value.contiguous(), group=info.group)
        full[name] = unshard_tensors(slices, param.partition_dim, param.partition_stride)
    return full
