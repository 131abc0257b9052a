"""Rebuilds each parameter's fp32 master and Adam state from DeepSpeed's flat partitions.

DeepSpeed keeps, per optimizer param group, one flat fp32 buffer of the group's trainable
parameters in ``param_shapes`` order, and each rank saves its part of it:

- ZeRO 1/2 (``single_partition_of_fp32_groups``): the group's flat buffer, padded at its end to a
  multiple of the world size, cut into equal consecutive partitions; saved without the padding
  (``group_paddings`` says how much the last rank's had). The optimizer's per-element state
  (``base_optimizer_state``) keeps the padding.
- BF16_Optimizer (``bf16_zero_*`` files): as ZeRO 1, but the saved fp32 partitions keep their
  padding too (``group_paddings`` per rank).
- ZeRO 3 (``fp32_flat_groups``, per sub-group): every parameter is partitioned on its own,
  padded to ``ceil(numel / world) * world``, and rank r's flat buffer is the concatenation of
  its ``ceil(numel / world)`` elements of each parameter, in ``param_shapes`` order.

Concatenating the ranks' partitions (padding dropped) gives ZeRO 1/2's flat buffer back; for
ZeRO 3 each parameter is the concatenation of the ranks' pieces, cut to its size. The same cuts
apply to every per-element optimizer state (``exp_avg``, ``exp_avg_sq``), which is what Adam
keeps element by element, so training continues as DeepSpeed's own resume would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointMismatchError, IncompleteCheckpointError
from .expert_groups import global_expert_names, partition_holders


@dataclass
class ParamState:
    """One trainable parameter as DeepSpeed saved it, whole: fp32 master and optimizer state
    (per-element tensors shaped flat like the master; scalars such as ``step`` as they are)."""

    name: str
    shape: tuple[int, ...]
    group: int
    master: torch.Tensor
    state: dict = field(default_factory=dict)


def _optimizer_dict(payload: dict, path) -> dict:
    inner = payload.get("optimizer_state_dict")
    if not isinstance(inner, dict):
        raise IncompleteCheckpointError(f"{path} has no 'optimizer_state_dict'")
    return inner


def _split_state(state: dict) -> tuple[dict, dict]:
    """(per-element tensors, scalars) of one flat buffer's optimizer state."""
    tensors = {k: v for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0}
    scalars = {k: v for k, v in state.items() if k not in tensors}
    return tensors, scalars


def _as_step(value):
    # deepspeed_cpp's Adam keeps its step as a 0-dim fp32 tensor (as torch.optim.Adam does).
    return torch.tensor(float(value)) if not torch.is_tensor(value) else value.float().clone()


def _scalars(scalars: dict) -> dict:
    return {k: _as_step(v) if k == "step" else v for k, v in scalars.items()}


def _walk(names_shapes, flat: dict[str, torch.Tensor], group: int, where: str) -> list[ParamState]:
    """Cuts a whole group's flat buffers (``flat["master"]`` and per-element states) into its
    parameters, in order."""
    params, offset = [], 0
    total = flat["master"].numel()
    for name, shape in names_shapes:
        numel = math.prod(shape)
        if offset + numel > total:
            raise IncompleteCheckpointError(
                f"{where}: parameter '{name}' ({numel} elements at {offset}) lies past the end "
                f"of its group's {total} saved fp32 elements"
            )
        cut = {k: v[offset : offset + numel].clone() for k, v in flat.items()}
        params.append(ParamState(name, tuple(shape), group, cut.pop("master"), cut))
        offset += numel
    if offset != total:
        raise IncompleteCheckpointError(
            f"{where}: param group {group} holds {total} fp32 elements, its parameters "
            f"(param_shapes) {offset}"
        )
    return params


def _flat_group(inners: list[dict], group: int, bf16: bool) -> tuple[dict, dict]:
    """A group's flat buffers (``"master"`` and per-element states) from the partitions of
    ``inners`` (its holders' optimizer dicts, in partition order), and its scalar state."""
    masters, states, scalars = [], [], {}
    for inner in inners:
        partition = inner["single_partition_of_fp32_groups"][group]
        # ZeRO 1/2 saves its masters trimmed already; BF16_Optimizer keeps the padding.
        padding = inner["group_paddings"][group] if bf16 else 0
        real = partition.numel() - padding
        masters.append(partition[:real])
        base = inner["base_optimizer_state"]["state"].get(group, {})
        tensors, scalars = _split_state(base)
        states.append({k: v[:real] for k, v in tensors.items()})
    flat = {"master": torch.cat(masters).float()}
    for key in states[0]:
        flat[key] = torch.cat([s[key] for s in states])
    return flat, scalars


def zero12_params(param_shapes: list, optims: list[dict], paths, bf16: bool) -> list[ParamState]:
    """The parameters of a ZeRO 1/2 or BF16_Optimizer checkpoint (see the module docstring);
    a MoE model's expert groups under their experts' global names (``expert_groups.py``)."""
    inners = [_optimizer_dict(o, p) for o, p in zip(optims, paths)]
    where = str(paths[0].parent)
    params: list[ParamState] = []
    for group, shapes in enumerate(param_shapes):
        count = inners[0].get("partition_count", [len(inners)] * len(param_shapes))[group]
        holders = partition_holders(len(inners), int(count), where)
        for expert_rank, ranks in enumerate(holders):
            flat, scalars = _flat_group([inners[r] for r in ranks], group, bf16)
            names_shapes = list(shapes.items())
            if len(holders) > 1:
                names_shapes = global_expert_names(names_shapes, expert_rank, where)
            cut = _walk(names_shapes, flat, group, where)
            for param in cut:
                param.state.update(_scalars(scalars))
            params.extend(cut)
    return params


def zero3_params(param_shapes: list, optims: list[dict], paths) -> list[ParamState]:
    """The parameters of a ZeRO 3 checkpoint (see the module docstring)."""
    world = len(optims)
    per_rank, scalars = [], {}
    for optim, path in zip(optims, paths):
        inner = _optimizer_dict(optim, path)
        flats = inner["fp32_flat_groups"]
        base = inner["optimizer_state_dict"]["state"]
        tensors = {}
        for sub_group in range(len(flats)):
            t, scalars = _split_state(base.get(sub_group, {}))
            for key, value in t.items():
                tensors.setdefault(key, []).append(value[: flats[sub_group].numel()])
        rank_flat = {"master": torch.cat(list(flats)).float()}
        rank_flat.update({k: torch.cat(v) for k, v in tensors.items()})
        per_rank.append(rank_flat)
    params, offset = [], 0
    for group, shapes in enumerate(param_shapes):
        for name, shape in shapes.items():
            numel = math.prod(shape)
            part = math.ceil(numel / world)
            if offset + part > per_rank[0]["master"].numel():
                raise IncompleteCheckpointError(
                    f"{paths[0].parent}: parameter '{name}' lies past the end of the ranks' "
                    f"saved fp32 partitions"
                )
            whole = {
                key: torch.cat([r[key][offset : offset + part] for r in per_rank])[:numel].clone()
                for key in per_rank[0]
            }
            master = whole.pop("master")
            params.append(
                ParamState(name, tuple(shape), group, master, {**whole, **_scalars(scalars)})
            )
            offset += part
    if offset != per_rank[0]["master"].numel():
        raise IncompleteCheckpointError(
            f"{paths[0].parent}: each rank holds {per_rank[0]['master'].numel()} fp32 elements, "
            f"the parameters' partitions (param_shapes) {offset}"
        )
    return params


def reassemble(model_payload: dict, optims: list[dict], paths, bf16: bool) -> list[ParamState]:
    """Every trainable parameter of a DeepSpeed checkpoint, whole (see the module docstring)."""
    param_shapes = model_payload.get("param_shapes")
    if not isinstance(param_shapes, list):
        raise IncompleteCheckpointError(
            f"{paths[0].parent}: the model states have no 'param_shapes' (list per param group)"
        )
    stage = None if bf16 else _optimizer_dict(optims[0], paths[0]).get("zero_stage")
    if stage is not None and int(stage) == 3:
        return zero3_params(param_shapes, optims, paths)
    if bf16 or (stage is not None and int(stage) in (1, 2)):
        return zero12_params(param_shapes, optims, paths, bf16)
    raise CheckpointMismatchError(
        f"{paths[0].parent}: the optimizer states say ZeRO stage {stage!r}; deepspeed_cpp reads "
        "DeepSpeed's ZeRO 1, 2 and 3 checkpoints (fp32, bf16, fp16)"
    )
