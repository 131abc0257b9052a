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
the single part's ``ZeroLayout.from_part`` with global names. This module sees the stage only
through its plain-data ``layout_parts()`` (``runtime/zero/stage.py``).
"""

from __future__ import annotations

import json
from dataclasses import replace

from ...comm.text_agreement import all_gather_text
from ...moe.expert_names import expert_layers, global_name
from .layout import optimizer_shard_file
from .metadata import ZeroLayout, names_by_parameter


def global_names_by_parameter(module) -> dict[int, list[str]]:
    """``id(param)`` -> every global name the module gives it."""
    layers = expert_layers(module)
    return {
        key: [global_name(name, layers) for name in names]
        for key, names in names_by_parameter(module).items()
    }


def _part_layouts(parts, names_of, world_size: int) -> list[tuple[str, int, ZeroLayout]]:
    """``(part key, first data-parallel rank of its group, its layout)`` of every part this rank
    takes part in, in the stage's order."""
    return [
        (
            part.key,
            part.group_ranks[0],
            ZeroLayout.from_part(part, names_of, optimizer_shard_file, world_size),
        )
        for part in parts
    ]


def _concatenated(parts: list[ZeroLayout]) -> tuple[ZeroLayout, list[int]]:
    """One layout with the parts' buckets one after another; each part's first bucket index."""
    params, buckets, starts = [], [], []
    for part in parts:
        starts.append(len(buckets))
        params.extend(replace(p, bucket=p.bucket + len(buckets)) for p in part.params)
        buckets.extend(part.buckets)
    first = parts[0]
    return ZeroLayout(first.stage, first.world_size, tuple(params), tuple(buckets)), starts


def trainable_ids(parts) -> set[int]:
    """``id`` of every parameter the stage trains (has fp32 masters for)."""
    return {id(p) for part in parts for p in part.layout.params}


def local_layout(parts, names_of, world_size: int) -> ZeroLayout:
    """The layout of this rank's parts only, its buckets in the order of the stage's
    ``owned_ranges()``: what a loading rank fills (no collective)."""
    return _concatenated([layout for _, _, layout in _part_layouts(parts, names_of, world_size)])[0]


def checkpoint_layout(parts, names_of, group, world_size: int) -> tuple[ZeroLayout, list[int]]:
    """The layout of every part on every rank (collective over ``group`` when some part spans
    only some of the data-parallel ranks: an expert set) and, for each of this rank's buckets
    (``owned_ranges()`` order), its index in it."""
    mine = _part_layouts(parts, names_of, world_size)
    everyone = tuple(range(world_size))
    if all(part.group_ranks == everyone for part in parts):
        # Every rank holds the same parts: this rank's layout is the whole checkpoint's.
        layout = _concatenated([layout for _, _, layout in mine])[0]
        return layout, list(range(len(layout.buckets)))
    # JSON text over tensor collectives: nothing another rank sent is unpickled.
    texts = all_gather_text(
        json.dumps([[key, first, layout.to_json()] for key, first, layout in mine]),
        "of the expert-parallel layouts in save_checkpoint",
        group,
    )
    gathered = [json.loads(text) for text in texts]
    unique = {(key, first): data for parts in gathered for key, first, data in parts}
    order = sorted(unique)
    full, starts = _concatenated([ZeroLayout.from_json(unique[k]) for k in order])
    indices = []
    for key, first, layout in mine:
        start = starts[order.index((key, first))]
        indices.extend(range(start, start + len(layout.buckets)))
    return full, indices


def bucket_writers(parts) -> list[bool]:
    """Per bucket of this rank (``owned_ranges()`` order): whether this rank saves its slice
    (at ZeRO-0 a part's buckets are identical on its group's ranks; the first one saves them)."""
    return [part.writes for part in parts for _ in part.layout.bucket_sizes]


def swapped_buckets(parts) -> frozenset[int]:
    """The buckets (``owned_ranges()`` order) whose optimizer state lives in NVMe swap files."""
    found, start = set(), 0
    for part in parts:
        found.update(start + b for b in part.swapped_buckets)
        start += len(part.layout.bucket_sizes)
    return frozenset(found)
