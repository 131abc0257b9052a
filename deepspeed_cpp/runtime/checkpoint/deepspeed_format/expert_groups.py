"""The expert param groups of a DeepSpeed ZeRO 1/2 checkpoint of a Mixture-of-Experts model.

DeepSpeed puts a MoE model's expert parameters in param groups of their own (``"moe": True``,
named after the layers' ``ep_size``). Such a group is partitioned over an expert-data-parallel
group, not over the whole world: with ``world`` ranks and expert parallelism ``E``, rank ``r`` is
expert-parallel rank ``r % E`` and holds partition ``r // E`` of its experts' flat buffer; the
optimizer-states files say how many partitions a group has (``partition_count``, ``world / E``).
Every rank names its experts by their *local* index (``...deepspeed_experts.<i>.``), and the
model-states file's ``param_shapes`` are rank 0's; expert-parallel rank ``e`` holds the global
experts ``e * num_local + i``, the index DeepSpeed's per-expert files
(``layer_<L>_expert_<E>_mp_rank_00_model_states.pt``) and deepspeed_cpp's checkpoints use.
"""

from __future__ import annotations

import re
from dataclasses import replace

from ..errors import CheckpointMismatchError

_EXPERT = re.compile(r"^(?P<prefix>(?:.*\.)?deepspeed_moe\.experts\.deepspeed_experts\.)"
                     r"(?P<index>\d+)\.(?P<rest>.+)$")  # fmt: skip


def partition_holders(world: int, partition_count: int, where: str) -> list[list[int]]:
    """Per expert-parallel rank ``e``: the ranks holding the partitions of its group, in
    partition order (``e, e + E, e + 2E, ...``); one list of every rank for a dense group."""
    if partition_count <= 0 or world % partition_count:
        raise CheckpointMismatchError(
            f"{where}: a param group is split into {partition_count} partitions, which does not "
            f"divide the {world} ranks that saved it"
        )
    expert_parallel = world // partition_count
    return [list(range(e, world, expert_parallel)) for e in range(expert_parallel)]


def global_expert_names(names_shapes: list, expert_rank: int, where: str) -> list:
    """``names_shapes`` (local expert names) as expert-parallel rank ``expert_rank`` holds
    them, under global names; every name must be an expert's (a MoE group holds nothing else)."""
    parsed = []
    local_indices: dict[str, set[int]] = {}
    for name, shape in names_shapes:
        match = _EXPERT.match(name)
        if match is None:
            raise CheckpointMismatchError(
                f"{where}: '{name}' is in an expert-parallel param group (partitioned over fewer "
                "ranks than the world) but is not a MoE expert's parameter "
                "('...deepspeed_moe.experts.deepspeed_experts.<i>.')"
            )
        parsed.append((match, shape))
        local_indices.setdefault(match["prefix"], set()).add(int(match["index"]))
    renamed = []
    for match, shape in parsed:
        num_local = len(local_indices[match["prefix"]])
        index = expert_rank * num_local + int(match["index"])
        renamed.append((f"{match['prefix']}{index}.{match['rest']}", shape))
    return renamed


def engine_groups(saved: list[tuple[str, int]], current, where: str) -> dict[int, int]:
    """DeepSpeed's optimizer built from the config puts a MoE model's expert parameters in
    param groups of their own (``configure_moe_param_groups``); our engine given the same
    parameter list keeps them in the user's group (its expert sets are internal). Maps each
    saved group (``saved``: ``(name, group)`` of every saved parameter) to the engine's group of
    its parameters (``current``: the engine's layout); a saved group whose parameters sit in
    two engine groups is refused by name."""
    by_name = current.by_name()
    mapping: dict[int, int] = {}
    for name, group in saved:
        record = by_name.get(name)
        if record is None:
            continue  # an expert another rank holds: its group follows from its peers'
        seen = mapping.setdefault(group, record.group)
        if seen != record.group:
            raise CheckpointMismatchError(
                f"{where}: the checkpoint's param group {group} holds parameters of this "
                f"engine's groups {seen} and {record.group} ('{name}')"
            )
    return mapping


def merged_param_groups(param_groups: list[dict], mapping: dict[int, int], count: int, where):
    """The saved groups' hyper-parameters per engine group (``count`` of them); the saved groups
    mapped to one engine group must agree (DeepSpeed's expert groups copy their origin's)."""
    merged: dict[int, dict] = {}
    for saved, target in sorted(mapping.items()):
        options = param_groups[saved] if saved < len(param_groups) else {}
        first = merged.setdefault(target, options)
        if first != options:
            raise CheckpointMismatchError(
                f"{where}: the checkpoint's param groups for this engine's group {target} differ "
                f"({first} and {options}); give initialize() the param groups DeepSpeed had "
                "(moe.utils.split_params_into_different_moe_groups_for_optimizer)"
            )
    return [merged.get(g, {}) for g in range(count)]


def _group_count(current) -> int:
    return 1 + max((r.group for r in current.params), default=0)


def _one_to_one(mapping: dict[int, int], count: int, param_groups: list) -> bool:
    return all(k == v for k, v in mapping.items()) and count == len(param_groups)


def regroup_to_engine(params: list, param_groups: list[dict], current, where: str) -> list[dict]:
    """``engine_groups`` applied to a DeepSpeed checkpoint's ``params`` (renumbered in place);
    returns the saved hyper-parameters per engine group. Nothing changes when the groups
    already correspond one to one."""
    mapping = engine_groups([(p.name, p.group) for p in params], current, where)
    count = _group_count(current)
    if _one_to_one(mapping, count, param_groups):
        return param_groups
    for param in params:
        param.group = mapping.get(param.group, param.group)
    return merged_param_groups(param_groups, mapping, count, where)


def regroup_layout(layout, param_groups: list[dict], current, where: str):
    """``regroup_to_engine`` for a converted DeepSpeed checkpoint, whose saved layout keeps
    DeepSpeed's groups: ``(layout with the engine's group numbers, hyper-parameters per engine
    group)``."""
    mapping = engine_groups([(r.name, r.group) for r in layout.params], current, where)
    count = _group_count(current)
    if _one_to_one(mapping, count, param_groups):
        return layout, param_groups
    params = tuple(replace(r, group=mapping.get(r.group, r.group)) for r in layout.params)
    buckets = tuple(replace(b, group=mapping.get(b.group, b.group)) for b in layout.buckets)
    regrouped = replace(layout, params=params, buckets=buckets)
    return regrouped, merged_param_groups(param_groups, mapping, count, where)
