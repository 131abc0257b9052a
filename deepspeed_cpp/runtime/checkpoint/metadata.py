"""The plain-data description of a checkpoint: where every parameter's fp32 values live.

ZeRO keeps the trainable parameters in flat fp32 buckets (``deepspeed_cpp.ops.zero``'s plan);
each rank's shard file holds some slices of some buckets. ``ZeroLayout`` records, per
parameter, its names, shape, dtype, optimizer param group, bucket and offset in the bucket, and,
per bucket, its size and which file holds which slice of it. That is all a reader needs to
rebuild any parameter (or its optimizer state) from the files, so resharding to another world
size and consolidating into one ``state_dict`` need no engine and no process group. It is stored
as JSON in ``checkpoint_meta.json`` (``ZeroLayout.to_json`` adds, for people reading it, each
parameter's owning ranks and the ranges they hold).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class ParamRecord:
    """One trainable parameter: its names (the first is used as its key), shape and place."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    group: int
    bucket: int
    offset: int

    @property
    def name(self) -> str:
        return self.names[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ShardSlice:
    """The slice ``[start, start + size)`` of a bucket, held in ``file`` written by ``rank``."""

    rank: int
    file: str
    start: int
    size: int


@dataclass(frozen=True)
class BucketRecord:
    size: int
    group: int
    slices: tuple[ShardSlice, ...]


@dataclass(frozen=True)
class Piece:
    """Elements ``[param_start, param_stop)`` of ``param`` sit at ``bucket_start`` onwards."""

    param: ParamRecord
    param_start: int
    param_stop: int
    bucket_start: int


@dataclass(frozen=True)
class ZeroLayout:
    """Where every trainable parameter's fp32 master values live in a set of shard files."""

    stage: int
    world_size: int
    params: tuple[ParamRecord, ...]
    buckets: tuple[BucketRecord, ...]

    # --- queries ------------------------------------------------------------------------------
    def by_name(self) -> dict[str, ParamRecord]:
        """Every name (aliases of tied parameters included) -> its record."""
        return {name: record for record in self.params for name in record.names}

    def members(self, bucket: int) -> list[ParamRecord]:
        return [p for p in self.params if p.bucket == bucket]

    def pieces(self, bucket: int, start: int, stop: int) -> Iterator[Piece]:
        """The parts of parameters that fall in ``[start, stop)`` of ``bucket`` (padding, which
        belongs to no parameter, yields nothing)."""
        for param in self.members(bucket):
            low = max(start, param.offset)
            high = min(stop, param.offset + param.numel)
            if low < high:
                yield Piece(param, low - param.offset, high - param.offset, low)

    def files(self) -> list[str]:
        """The shard files that hold bucket slices, in rank order."""
        seen = {s.rank: s.file for b in self.buckets for s in b.slices}
        return [seen[rank] for rank in sorted(seen)]

    def same_bucket_contents(self, other: ZeroLayout, bucket: int) -> bool:
        """Whether ``bucket`` has the same size and the same parameters at the same offsets in
        both layouts (then its slices can be copied whole, whatever the optimizer keeps)."""
        if bucket >= len(other.buckets) or self.buckets[bucket].size != other.buckets[bucket].size:
            return False
        placed = {(p.name, p.offset, p.numel) for p in self.members(bucket)}
        return placed == {(p.name, p.offset, p.numel) for p in other.members(bucket)}

    # --- building -----------------------------------------------------------------------------
    @classmethod
    def from_part(
        cls, part, names_of: dict[int, list[str]], shard_file, world_size: int | None = None
    ) -> ZeroLayout:
        """The layout of one ``LayoutPart`` of a live stage (``runtime/zero/stage.py``):
        ``names_of`` maps ``id(param)`` to its names in the module, ``shard_file(rank)`` names a
        data-parallel rank's file. Slices name the data-parallel ranks of the part's group and
        param groups the user's; ``world_size``: the data-parallel world's (default: the part's
        group's)."""
        layout = part.layout
        origins = part.param_group_origins
        params = []
        for index, param in enumerate(layout.params):
            names = names_of.get(id(param)) or [f"<optimizer parameter {index}>"]
            bucket = layout.param_bucket[index]
            params.append(
                ParamRecord(
                    names=tuple(names),
                    shape=tuple(getattr(param, "ds_shape", param.shape)),
                    dtype=dtype_name(param.dtype),
                    group=origins[layout.bucket_groups[bucket]],
                    bucket=bucket,
                    offset=layout.param_offset[index],
                )
            )
        ranks = part.group_ranks
        buckets = []
        for bucket, size in enumerate(layout.bucket_sizes):
            if layout.replicated:
                # Every rank holds the whole bucket, identical; the group's first rank saves it.
                slices = (ShardSlice(ranks[0], shard_file(ranks[0]), 0, size),)
            else:
                shard = size // layout.world_size
                slices = tuple(
                    ShardSlice(ranks[r], shard_file(ranks[r]), r * shard, shard)
                    for r in range(layout.world_size)
                )
            buckets.append(BucketRecord(size, origins[layout.bucket_groups[bucket]], slices))
        world = layout.world_size if world_size is None else world_size
        return cls(part.stage, world, tuple(params), tuple(buckets))

    # --- JSON ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        buckets = [
            {
                "size": b.size,
                "group": b.group,
                "padding": b.size - sum(p.numel for p in self.members(i)),
                "slices": [
                    {"rank": s.rank, "file": s.file, "start": s.start, "size": s.size}
                    for s in b.slices
                ],
            }
            for i, b in enumerate(self.buckets)
        ]
        params = []
        for p in self.params:
            owners = []
            for s in self.buckets[p.bucket].slices:
                low, high = max(s.start, p.offset), min(s.start + s.size, p.offset + p.numel)
                if low < high:
                    owners.append(
                        {
                            "rank": s.rank,
                            "file": s.file,
                            "param_range": [low - p.offset, high - p.offset],
                            "slice_range": [low - s.start, high - s.start],
                        }
                    )
            params.append(
                {
                    "names": list(p.names),
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "numel": p.numel,
                    "group": p.group,
                    "bucket": p.bucket,
                    "offset": p.offset,
                    "owners": owners,
                }
            )
        return {
            "stage": self.stage,
            "world_size": self.world_size,
            "params": params,
            "buckets": buckets,
        }

    @classmethod
    def from_json(cls, data: dict) -> ZeroLayout:
        params = tuple(
            ParamRecord(
                tuple(p["names"]),
                tuple(p["shape"]),
                p["dtype"],
                p["group"],
                p["bucket"],
                p["offset"],
            )
            for p in data["params"]
        )
        buckets = tuple(
            BucketRecord(
                b["size"],
                b["group"],
                tuple(ShardSlice(s["rank"], s["file"], s["start"], s["size"]) for s in b["slices"]),
            )
            for b in data["buckets"]
        )
        return cls(data["stage"], data["world_size"], params, buckets)


def names_by_parameter(module: torch.nn.Module) -> dict[int, list[str]]:
    """``id(param)`` -> every name the module gives it (several for tied parameters)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def plain(value):
    """A JSON-friendly copy of hyper-parameters and configs (tensors become numbers/lists)."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def to_json_text(value, indent: int = 0, width: int = 100) -> str:
    """JSON that people can read: a list or dict that fits on one line stays on one line."""
    flat = json.dumps(value)
    if len(flat) + indent <= width or not isinstance(value, (dict, list)) or not value:
        return flat
    inner = " " * (indent + 1)
    if isinstance(value, dict):
        items = [
            f"{inner}{json.dumps(str(k))}: {to_json_text(v, indent + 1, width)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{inner}{to_json_text(v, indent + 1, width)}" for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
