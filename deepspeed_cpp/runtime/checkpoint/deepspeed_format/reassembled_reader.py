"""Serves reassembled DeepSpeed parameters to ``reshard.Resharder`` as if they were shard files.

The ``Resharder`` cuts any engine's owned slices out of a saved ``ZeroLayout`` through a reader
(``shard_reader.ShardReader``'s methods). Here the saved layout is one bucket per parameter,
held whole by one pseudo-file, and the reader answers from the tensors in memory: DeepSpeed's
checkpoint then loads into any ZeRO stage and world size by the same code as ours does.
"""

from __future__ import annotations

import torch

from ..errors import IncompleteCheckpointError
from ..metadata import BucketRecord, ParamRecord, ShardSlice, ZeroLayout
from ..shard_reader import MASTER
from .flat_partitions import ParamState

PSEUDO_FILE = "<deepspeed checkpoint, reassembled>"


def layout_of(params: list[ParamState], stage: int, world_size: int) -> ZeroLayout:
    """One bucket per parameter, in order, each held whole."""
    records, buckets = [], []
    for index, param in enumerate(params):
        records.append(ParamRecord((param.name,), param.shape, "float32", param.group, index, 0))
        numel = param.master.numel()
        buckets.append(BucketRecord(numel, param.group, (ShardSlice(0, PSEUDO_FILE, 0, numel),)))
    return ZeroLayout(stage, world_size, tuple(records), tuple(buckets))


class ReassembledReader:
    """``ShardReader``'s interface over whole parameters in memory (bucket ``b`` = parameter
    ``b`` of ``params``)."""

    def __init__(self, params: list[ParamState], layout: ZeroLayout):
        self.params = params
        self.layout = layout

    def _value(self, key: str, bucket: int):
        param = self.params[bucket]
        if key == MASTER:
            return param.master
        if key not in param.state:
            raise IncompleteCheckpointError(
                f"the DeepSpeed checkpoint has no optimizer state '{key}' for '{param.name}'; it "
                f"has {sorted(param.state)}"
            )
        return param.state[key]

    def entry(self, piece: ShardSlice, bucket: int) -> dict:
        param = self.params[bucket]
        return {"start": 0, "size": param.master.numel(), "master": param.master,
                "state": param.state}  # fmt: skip

    def dtype(self, key: str, bucket: int) -> torch.dtype:
        return self._value(key, bucket).dtype

    def scalar(self, key: str, bucket: int):
        return self._value(key, bucket)

    def read(self, key: str, bucket: int, start: int, stop: int, out: torch.Tensor | None) -> None:
        values = self._value(key, bucket)
        if stop > values.numel():
            raise IncompleteCheckpointError(
                f"'{self.params[bucket].name}' {key}: elements [{start}, {stop}) asked, "
                f"{values.numel()} held"
            )
        if out is not None:
            out.copy_(values[start:stop])

    def release_pages(self) -> None:
        """Nothing is mapped."""

    def close(self) -> None:
        self.params = []
