"""What the offload tests share (test_offload_optimizer.py, test_offload_edge_cases.py,
test_streamed_save.py): their seed, their ds_config with or without ``offload_optimizer``, an
NVMe offload section, a training loop over ``zero3_helpers.global_batches`` and a copy of an
engine's optimizer shards."""

from __future__ import annotations

import torch
from zero3_helpers import config, loss_of, rank_slice

SEED = 11


def offload_config(stage, dtype, offload, *, gas=2, clip=0.5, sub_group_size=700) -> dict:
    """``zero3_helpers.config`` at ZeRO ``stage`` with ``offload`` as ``offload_optimizer``
    (None: in memory)."""
    result = config(dtype, gas, clip, threshold=50)
    result["zero_optimization"].update(stage=stage, sub_group_size=sub_group_size)
    if offload is not None:
        result["zero_optimization"]["offload_optimizer"] = offload
    return result


def nvme_offload(folder, **extra) -> dict:
    """An ``offload_optimizer`` section to NVMe under ``folder``, pipelined, three buffers."""
    return {"device": "nvme", "nvme_path": folder, "pipeline_read": True,
            "pipeline_write": True, "buffer_count": 3, **extra}  # fmt: skip


def run_steps(engine, batches, rank) -> None:
    """Trains ``engine`` on this rank's slice of each global batch (its micro-batches)."""
    for micro_batches in batches:
        for x, y in micro_batches:
            loss = loss_of(engine(rank_slice(x, rank)), rank_slice(y, rank))
            engine.backward(loss)
            engine.step()


def shard_states(engine) -> list[dict]:
    """Every bucket's master slice and optimizer state, copied (``shard_state``)."""
    return [
        {"master": e["master"].clone(),
         "state": {k: v.clone() if torch.is_tensor(v) else v for k, v in e["state"].items()}}
        for e in engine.optimizer.shard_state()
    ]  # fmt: skip
