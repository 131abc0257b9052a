"""The fp32 masters and optimizer state of a pipeline checkpoint, re-cut for another layout.

A pipeline checkpoint holds, per stage, a ``ZeroLayout`` of that stage's optimizer shards (one
file per replica, ``zero_pp_rank_D_mp_rank_SS_optim_states.pt``). Parameters keep their names
across layouts (``<layer index>.<name>``, ``tied_modules.<key>.<name>``), so the stages' layouts,
laid one after another, are one saved layout in which every parameter of any new partition is
found by name; the checkpoint's ``Resharder`` cuts this rank's owned slices out of it, master and
element-wise state (Adam's moments) alike, and carries the per-tensor counters (Adam's ``step``),
so that training at 1 stage x 2 replicas, or at 3 stages, goes on as the saved run would have.
A tied weight is saved by every stage that holds it, with equal values: either copy serves.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..checkpoint.errors import CheckpointMismatchError
from ..checkpoint.metadata import ShardSlice, ZeroLayout, names_by_parameter
from ..checkpoint.reshard import Resharder, classify_state
from ..checkpoint.shard_reader import ShardReader


def _saved_layout(stage_records: list[dict]) -> tuple[ZeroLayout, list[int]]:
    """The stages' layouts with their buckets one after another, and for every bucket of it the
    index it has in its own stage's shard files."""
    params, buckets, local_index = [], [], []
    for record in stage_records:
        if record.get("zero_layout") is None:
            raise CheckpointMismatchError(
                f"stage {record['stage']} of the checkpoint was saved without an optimizer: its "
                "optimizer state cannot be loaded (pass load_optimizer_states=False)"
            )
        layout = ZeroLayout.from_json(record["zero_layout"])
        params.extend(replace(p, bucket=p.bucket + len(buckets)) for p in layout.params)
        local_index.extend(range(len(layout.buckets)))
        buckets.extend(layout.buckets)
    first = ZeroLayout.from_json(stage_records[0]["zero_layout"])
    return ZeroLayout(first.stage, first.world_size, tuple(params), tuple(buckets)), local_index


class _PipelineShardReader(ShardReader):
    """A ``ShardReader`` over the pipeline's shard files, which hold per bucket of their stage
    ``masters[b]`` and ``states[b]`` (this rank's slice and its optimizer state)."""

    def __init__(self, directory: Path, layout: ZeroLayout, local_index: list[int], digests):
        super().__init__(directory, layout, digests)
        self._local_index = local_index

    def entry(self, piece: ShardSlice, bucket: int) -> dict:
        shard = self.file(piece.file)
        local = self._local_index[bucket]
        return {
            "start": piece.start,
            "size": piece.size,
            "master": shard["masters"][local],
            "state": shard["states"][local],
        }


def resharded_optimizer_state(
    zero, module, directory: Path, stage_records: list[dict], digests: dict
) -> tuple[list[torch.Tensor], list[dict]]:
    """This rank's master slices and optimizer state, per bucket of ``zero`` (this stage's
    ZeRO stage, over ``module``'s parameters), cut out of every saved stage's shards (reads
    only; nothing is loaded into the engine)."""
    saved, local_index = _saved_layout(stage_records)
    reader = _PipelineShardReader(directory, saved, local_index, digests)
    try:
        first = reader.entry(saved.buckets[0].slices[0], 0)
        kinds = {key: classify_state(v, first["master"]) for key, v in first["state"].items()}
        (part,) = zero.layout_parts()  # a pipeline stage has no expert sets
        target = ZeroLayout.from_part(part, names_by_parameter(module), lambda replica: "")
        saved_names = saved.by_name()
        missing = [p.name for p in target.params if p.name not in saved_names]
        if missing:
            raise CheckpointMismatchError(
                f"{directory} holds no optimizer state for {missing[:5]} (of {len(missing)})"
            )
        masters, states = Resharder(reader, target, kinds).slices_for(
            zero.owned_ranges(), with_state=True
        )
    finally:
        reader.close()
    return masters, states
