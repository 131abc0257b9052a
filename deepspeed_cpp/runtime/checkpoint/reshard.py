"""Re-cuts a checkpoint's fp32 masters and optimizer state for another ZeRO plan.

A checkpoint saved by N ranks holds, per bucket, N slices (one for ZeRO-0). A new engine — M
ranks, any stage, its own bucket plan — owns one slice of each of its own buckets. Each element
of a new slice belongs to one parameter (or is padding); its value is found through the saved
layout by that parameter's name and element index. Adam-family updates are element-wise, so
element-wise optimizer state (``exp_avg``, ``exp_avg_sq``, momentum buffers...) moves the same
way, and training continues exactly as it would have without the stop. Padding is zero in the
masters and in the state, as it is during training.

When a new bucket has the same parameters at the same offsets as the saved one and the saved
files hold exactly the slice this rank owns (same world size and stage kind), the slice is
copied whole, which also carries state that is not element-wise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import CheckpointMismatchError
from .metadata import ShardSlice, ZeroLayout
from .shard_reader import MASTER, ShardReader

ELEMENTWISE = "elementwise"
SCALAR = "scalar"
OTHER = "other"


def classify_state(value, master: torch.Tensor) -> str:
    """How one optimizer-state value relates to the master slice it belongs to."""
    if isinstance(value, torch.Tensor):
        if value.shape == master.shape:
            return ELEMENTWISE
        return SCALAR if value.dim() == 0 else OTHER
    return SCALAR


def _copy(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _copy_unless_per_element(value):
    # A 0-dim view would keep the whole shard file mapped for as long as the home holds it.
    keep = isinstance(value, torch.Tensor) and value.dim() > 0
    return value if keep else _copy(value)


def _whole_slice(saved: ZeroLayout, target: ZeroLayout, bucket: int, start: int, size: int):
    if not target.same_bucket_contents(saved, bucket):
        return None
    for piece in saved.buckets[bucket].slices:
        if (piece.start, piece.size) == (start, size):
            return piece
    return None


class Resharder:
    """Builds, for one rank of a new engine, its master slices and optimizer state."""

    def __init__(self, reader: ShardReader, target: ZeroLayout, state_kinds: dict[str, str]):
        self.reader = reader
        self.saved = reader.layout
        self.target = target
        self.state_kinds = state_kinds
        self._saved_by_name = self.saved.by_name()

    def _saved_record(self, name: str):
        return self._saved_by_name[name]

    def _gather(self, key: str, bucket: int, start: int, size: int) -> torch.Tensor:
        members = self.target.members(bucket)
        first = self._saved_record(members[0].name)
        dtype = torch.float32 if key == MASTER else self.reader.dtype(key, first.bucket)
        out = torch.zeros(size, dtype=dtype)
        for piece in self.target.pieces(bucket, start, start + size):
            saved = self._saved_record(piece.param.name)
            low = piece.bucket_start - start
            high = low + piece.param_stop - piece.param_start
            self.reader.read(
                key,
                saved.bucket,
                saved.offset + piece.param_start,
                saved.offset + piece.param_stop,
                out[low:high],
            )
        return out

    def _scalar(self, key: str, bucket: int):
        members = self.target.members(bucket)
        saved_buckets = sorted({self._saved_record(p.name).bucket for p in members})
        value = self.reader.scalar(key, saved_buckets[0])
        for other in saved_buckets[1:]:
            candidate = self.reader.scalar(key, other)
            same = (
                torch.equal(candidate, value)
                if isinstance(value, torch.Tensor) and isinstance(candidate, torch.Tensor)
                else candidate == value
            )
            if not same:
                raise CheckpointMismatchError(
                    f"optimizer state '{key}' differs between saved buckets {saved_buckets[0]} "
                    f"({value}) and {other} ({candidate}), which this engine's bucket {bucket} "
                    f"merges ({[p.name for p in members]}); it cannot be resharded"
                )
        return _copy(value)

    def _state(self, bucket: int, start: int, size: int) -> dict:
        state = {}
        for key, kind in self.state_kinds.items():
            if kind == ELEMENTWISE:
                state[key] = self._gather(key, bucket, start, size)
            elif kind == SCALAR:
                state[key] = self._scalar(key, bucket)
            else:
                raise CheckpointMismatchError(
                    f"optimizer state '{key}' is neither element-wise nor a scalar, so it "
                    f"cannot be resharded from the checkpoint's layout (ZeRO stage "
                    f"{self.saved.stage}, {self.saved.world_size} ranks) to this engine's "
                    f"(stage {self.target.stage}, {self.target.world_size} ranks); load at the "
                    f"saved layout, or pass load_optimizer_states=False"
                )
        return state

    def slices_for(
        self,
        owned: Sequence[tuple[int, int]],
        with_state: bool,
        mapped: frozenset[int] = frozenset(),
    ) -> tuple[list[torch.Tensor], list[dict] | None]:
        """For every bucket of the target plan, the master values of the owned slice
        ``(start, size)`` and (``with_state``) the optimizer state for it. A bucket in
        ``mapped`` saved whole gets the views of the memory-mapped shard file, not copies: its
        state goes to NVMe swap files, copied there one sub-group at a time, so the rank's
        state never sits in host memory at once (the mapped pages are clean page cache)."""
        masters: list[torch.Tensor] = []
        states: list[dict] | None = [] if with_state else None
        for bucket, (start, size) in enumerate(owned):
            whole: ShardSlice | None = _whole_slice(self.saved, self.target, bucket, start, size)
            if whole is not None:
                entry = self.reader.entry(whole, bucket)
                copy = _copy if bucket not in mapped else _copy_unless_per_element
                masters.append(copy(entry["master"]))
                if states is not None:
                    states.append({k: copy(v) for k, v in entry["state"].items()})
                continue
            masters.append(self._gather(MASTER, bucket, start, size))
            if states is not None:
                states.append(self._state(bucket, start, size))
        return masters, states
