"""All-gather of equal shards into one flat tensor, with the collective that is fastest on the
group's backend.

gloo's all-gather is slow: one broadcast per rank (each rank sends its own shard) moves the same
bytes 1.1x faster with 6M-element buckets on 2 CPU processes, 2.5x with 48M, and 1.8x on 3
processes (``benchmarks/bench_collectives.py``): torch's gloo all-gather gathers into a freshly
allocated flat tensor and copies that into the output, where a broadcast lands in place and the
ranks' broadcasts run side by side on gloo's threads. ZeRO-1/2's parameter gathers and ZeRO-3's
unit gathers (and the agreement's stand-ins for them) all follow ``gathers_by_broadcast``. Other
backends (NCCL) use their own all-gather.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def backend_for(group: dist.ProcessGroup, device: torch.device) -> str:
    """The name of the backend ``group`` uses for tensors on ``device`` (e.g. "gloo", "nccl")."""
    name = dist.get_backend(group)
    for part in name.split(","):  # a group made as "cpu:gloo,cuda:nccl"
        device_type, _, backend = part.rpartition(":")
        if not device_type or device_type == device.type:
            return backend
    return name


def gathers_by_broadcast(group, device: torch.device) -> bool:
    """Whether all-gathers on ``group`` for tensors on ``device`` go by one broadcast per rank
    (gloo: faster than its all-gather, above) rather than the backend's all-gather."""
    return backend_for(group or dist.group.WORLD, device) == "gloo"


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group) -> dist.Work:
    """Starts one all-gather of every rank's ``shard`` into the flat ``output`` (rank order).
    torch 2.14 calls it ``all_gather_single`` (``all_gather_into_tensor`` now warns that it is
    deprecated); torch 2.11 has only the old name. Looked up per call: the comms logger swaps
    torch.distributed's functions while it is on."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, shard, group=group, async_op=True)


def launch_all_gather(
    full: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    by_broadcast: bool,
    own_in_full: bool = True,
) -> list[dist.Work]:
    """Starts filling the 1-D ``full`` with every rank's shard (rank r's at ``r * len(shard)``);
    ``shard`` is this rank's (it may differ from ``full`` in dtype, then it is cast, or already be
    ``full``'s own slice, then nothing is copied). With ``by_broadcast`` and not
    ``own_in_full``, this rank's slice of ``full`` is left as it is (the caller reads its own
    part from ``shard``): the broadcast sends straight from ``shard``. The caller waits on the
    returned works before reading ``full``."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    size = shard.numel()
    if full.numel() != size * world_size:
        raise ValueError(
            f"all-gather of {world_size} shards of {size} elements needs a full tensor of "
            f"{size * world_size}, got {full.numel()}"
        )
    if not by_broadcast:
        source = shard if shard.dtype == full.dtype else shard.to(full.dtype)
        return [all_gather_flat(full, source, group)]
    own = full.narrow(0, rank * size, size)
    if not own_in_full and shard.dtype == full.dtype:
        own = shard
    elif own.data_ptr() != shard.data_ptr() or own.dtype != shard.dtype:  # not already in place
        own.copy_(shard)
    return [
        dist.broadcast(
            own if r == rank else full.narrow(0, r * size, size),
            group_src=r,
            group=group,
            async_op=True,
        )
        for r in range(world_size)
    ]
