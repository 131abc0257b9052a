"""A tensor a checkpoint names before its bytes are in memory.

With NVMe offload a rank's optimizer state lives in swap files. A checkpoint save that copied all
of it out first would hold the whole state in host memory; instead the optimizer describes each
offloaded tensor by its dtype and size (``DeferredTensor``) and hands out its bytes one sub-group
at a time, read into the home's swap buffers (``ShardCheckpointState.stream_shard_state``). The
checkpoint writer (``runtime/checkpoint/streamed_save.py``) pickles the description exactly as
``torch.save`` pickles a contiguous tensor of that dtype and size, then writes the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)  # identity, not value: two equal-looking entries are two records
class DeferredTensor:
    """A 1-D contiguous tensor of ``numel`` elements of ``dtype``: ``bucket``'s master
    (``key`` None) or its per-element optimizer state ``key``; ``reader.view(self)`` gives its
    bytes (``shard_checkpoint_state.SubGroupReader``)."""

    dtype: torch.dtype
    numel: int
    bucket: int
    key: str | None
    reader: object = field(repr=False)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty(0, dtype=self.dtype).element_size()


class PendingValues:
    """A 1-D tensor a checkpoint load names before reading it: ``read_into(out)`` copies its
    ``numel`` values of ``dtype`` into ``out`` when asked. A resharded load into NVMe swap
    files hands these to ``ShardCheckpointState.load_shard_state``, which reads each one while
    its sub-group is resident, so the rank's state is never in host memory at once
    (``runtime/checkpoint/reshard.py``, ``GatheredSlice``)."""

    dtype: torch.dtype
    numel: int

    @property
    def shape(self) -> tuple[int]:
        return (self.numel,)

    def read_into(self, out: torch.Tensor) -> None:
        raise NotImplementedError

    def materialize(self) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=self.dtype)
        self.read_into(out)
        return out
