"""The ``ZeroLayout`` of an engine with expert-parallel (ep_size > 1) MoE layers.

Such an engine keeps its trainable parameters in sets (``runtime/zero/moe_stage.py``): the dense
set sharded over the whole world, and per expert group name one set per expert-data-parallel
group, each sharded over that group and holding other experts. Each set has its own bucket plan.
A checkpoint describes them with one ordinary ``ZeroLayout`` in which

- parameters carry global names (``moe/expert_names.py``), so the experts of every group are
  distinct parameters;
- the sets' buckets follow one another: the dense set's, then per expert group name, the
  buckets of each expert-data-parallel group in the order of the group's first rank;
- a bucket's slices name the world ranks (and their shard files) that hold them, and its param
  group is the user's param group the set's part came from.

Resharding and consolidation then read it like any other checkpoint (``reshard.py``,
``utils/zero_to_fp32.py``). An engine without such layers has one set, and its layout is
``ZeroLayout.from_optimizer``'s with global names.
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...moe.expert_names import expert_layers, global_name
from ..zero.moe_stage import ExpertParallelZeroStage
from .layout import optimizer_shard_file
from .metadata import BucketRecord, ZeroLayout, names_by_parameter


def global_names_by_parameter(module) -> dict[int, list[str]]:
    """``id(param)`` -> every global name the module gives it."""
    layers = expert_layers(module)
    return {
        key: [global_name(name, layers) for name in names]
        for key, names in names_by_parameter(module).items()
    }


def _set_layouts(zero, names_of) -> list[tuple[str, int, ZeroLayout]]:
    """``(set key, first world rank of its group, layout in world ranks and user groups)`` of
    every set this rank takes part in, in the stage's set order."""
    if not isinstance(zero, ExpertParallelZeroStage):
        return [("", 0, ZeroLayout.from_optimizer(zero, names_of, optimizer_shard_file))]
    parts = []
    for key, member, origins in zip(zero.keys, zero.sets, zero.origins):
        ranks = dist.get_process_group_ranks(member.group)
        files = [optimizer_shard_file(rank) for rank in ranks]
        own = ZeroLayout.from_optimizer(member, names_of, files.__getitem__)
        buckets = tuple(
            BucketRecord(
                b.size, origins[b.group], tuple(replace(s, rank=ranks[s.rank]) for s in b.slices)
            )
            for b in own.buckets
        )
        params = tuple(replace(p, group=origins[p.group]) for p in own.params)
        parts.append((key, ranks[0], ZeroLayout(own.stage, dist.get_world_size(), params, buckets)))
    return parts


def _concatenated(parts: list[ZeroLayout]) -> tuple[ZeroLayout, list[int]]:
    """One layout with the parts' buckets one after another; each part's first bucket index."""
    params, buckets, starts = [], [], []
    for part in parts:
        starts.append(len(buckets))
        params.extend(replace(p, bucket=p.bucket + len(buckets)) for p in part.params)
        buckets.extend(part.buckets)
    first = parts[0]
    return ZeroLayout(first.stage, first.world_size, tuple(params), tuple(buckets)), starts


def local_layout(zero, names_of) -> ZeroLayout:
    """The layout of this rank's sets only, its buckets in the order of ``zero.owned_ranges()``:
    what a loading rank fills (no collective)."""
    return _concatenated([layout for _, _, layout in _set_layouts(zero, names_of)])[0]


def checkpoint_layout(zero, names_of, group) -> tuple[ZeroLayout, list[int]]:
    """The layout of every set on every rank (collective over ``group`` with expert sets) and,
    for each of this rank's buckets (``zero.owned_ranges()`` order), its index in it."""
    mine = _set_layouts(zero, names_of)
    if not isinstance(zero, ExpertParallelZeroStage):
        layout = mine[0][2]
        return layout, list(range(len(layout.buckets)))
    gathered: list = [None] * dist.get_world_size(group)
    with named_collective("all_gather of the expert-parallel layouts in save_checkpoint"):
        dist.all_gather_object(
            gathered, [(key, first, layout.to_json()) for key, first, layout in mine], group=group
        )
    unique = {(key, first): data for parts in gathered for key, first, data in parts}
    order = sorted(unique)
    full, starts = _concatenated([ZeroLayout.from_json(unique[k]) for k in order])
    indices = []
    for key, first, layout in mine:
        start = starts[order.index((key, first))]
        indices.extend(range(start, start + len(layout.buckets)))
    return full, indices


def bucket_writers(zero) -> list[bool]:
    """Per bucket of this rank (``owned_ranges()`` order): whether this rank saves its slice
    (at ZeRO-0 a set's buckets are identical on its group's ranks; the first one saves them)."""
    members = zero.sets if isinstance(zero, ExpertParallelZeroStage) else [zero]
    return [
        member.stage > 0 or member.rank == 0 for member in members for _ in member.owned_ranges()
    ]
