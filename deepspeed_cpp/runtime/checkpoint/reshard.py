"""Re-cuts a checkpoint's fp32 masters and optimizer state for another ZeRO plan.

A checkpoint saved by N ranks holds, per bucket, N slices (one for ZeRO-0). A new engine — M
ranks, any stage, its own bucket plan — owns one slice of each of its own buckets. Each element
of a new slice belongs to one parameter (or is padding); its value is found through the saved
layout by that parameter's name and element index. Adam-family updates are element-wise, so
element-wise optimizer state (``exp_avg``, ``exp_avg_sq``, momentum buffers...) moves the same
way, and training continues exactly as it would have without the stop. Padding is zero in the
masters and in the state, as it is during training.

With NVMe offload (``mapped`` buckets) a re-cut slice is not built here: it is a
``GatheredSlice``, checked now against the files and read later, while its sub-group is resident
in the swap buffers, so that the rank's state is never in host memory at once.

When a new bucket has the same parameters at the same offsets as the saved one and the saved
files hold exactly the slice this rank owns (same world size and stage kind), the slice is
copied whole, which also carries state that is not element-wise.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..zero.offload.deferred_tensor import PendingValues
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

    def _dtype(self, key: str, bucket: int) -> torch.dtype:
        if key == MASTER:
            return torch.float32
        first = self._saved_record(self.target.members(bucket)[0].name)
        return self.reader.dtype(key, first.bucket)

    def read_slice(
        self, key: str, bucket: int, start: int, size: int, out: torch.Tensor | None
    ) -> None:
        """Fills ``out`` (zeroed: padding stays zero) with ``key``'s values for the elements
        ``[start, start + size)`` of the target ``bucket``; ``out`` None: only checks that the
        files hold them (``ShardReader.read``)."""
        for piece in self.target.pieces(bucket, start, start + size):
            saved = self._saved_record(piece.param.name)
            low = piece.bucket_start - start
            high = low + piece.param_stop - piece.param_start
            self.reader.read(
                key,
                saved.bucket,
                saved.offset + piece.param_start,
                saved.offset + piece.param_stop,
                None if out is None else out[low:high],
            )

    def _gather(self, key: str, bucket: int, start: int, size: int) -> torch.Tensor:
        out = torch.zeros(size, dtype=self._dtype(key, bucket))
        self.read_slice(key, bucket, start, size, out)
        return out

    def _pending(self, key: str, bucket: int, start: int, size: int) -> GatheredSlice:
        self.read_slice(key, bucket, start, size, None)
        return GatheredSlice(self, key, bucket, start, size, self._dtype(key, bucket))

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

    def _state(self, bucket: int, start: int, size: int, pending: bool) -> dict:
        state = {}
        gather = self._pending if pending else self._gather
        for key, kind in self.state_kinds.items():
            if kind == ELEMENTWISE:
                state[key] = gather(key, bucket, start, size)
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
        ``mapped`` saved whole gets the views of the memory-mapped shard file, not copies, and
        one re-cut gets ``GatheredSlice``s: its state goes to NVMe swap files, copied there one
        sub-group at a time, so the rank's state never sits in host memory at once (the
        mapped pages are clean page cache, given back as they are copied)."""
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
            pending = bucket in mapped
            gather = self._pending if pending else self._gather
            masters.append(gather(MASTER, bucket, start, size))
            if states is not None:
                states.append(self._state(bucket, start, size, pending))
        if mapped:
            self.reader.release_pages()  # what checking and the scalars' reads mapped
        return masters, states


class GatheredSlice(PendingValues):
    """One re-cut slice (``key`` of the target ``bucket``, elements ``[start, start + numel)``),
    checked against the files when made and read from them by ``read_into``: the
    ``Resharder``'s reader must stay open until then."""

    def __init__(
        self, resharder: Resharder, key: str, bucket: int, start: int, numel: int, dtype
    ) -> None:
        self._resharder, self.key, self.bucket, self.start = resharder, key, bucket, start
        self.numel, self.dtype = numel, dtype

    def read_into(self, out: torch.Tensor) -> None:
        if out.dtype != self.dtype or out.shape != self.shape:
            raise ValueError(
                f"GatheredSlice of bucket {self.bucket} '{self.key}' is {self.dtype} x "
                f"{self.numel}; the destination is {out.dtype} x {tuple(out.shape)}"
            )
        out.zero_()  # padding between and after the parameters is zero, as in training
        self._resharder.read_slice(self.key, self.bucket, self.start, self.numel, out)
        self._resharder.reader.release_pages()
