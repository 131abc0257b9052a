"""All-gather of equal shards into one flat tensor, with the collective that is fastest on the
group's backend.

gloo's all-gather is slow: torch's gloo all-gather gathers into a freshly allocated flat tensor
and copies that into the output. So on gloo each rank's shard is *exchanged* instead, landing in
place: between 2 ranks with one all-to-all (each rank sends its shard to the other and nothing to
itself: one collective, nothing copied), among more with one broadcast per rank (the ranks'
broadcasts run side by side on gloo's threads). ``python benchmarks/bench_collectives.py
--elements E --bucket E --repeats 9``, 2 CPU processes: 1.6M elements, all-gather 7.2 ms,
broadcasts 3.4 ms, all-to-all 3.3 ms; 6M, 17.2 / 14.1 / 11.0 ms (and broadcasts 1.8x faster
than the all-gather on 3 processes). ZeRO-1/2's parameter gathers and ZeRO-3's unit gathers
(and the agreement's stand-ins for them) all follow ``gathers_by_exchange``. Other backends
(NCCL) use their own all-gather.
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


def gathers_by_exchange(group, device: torch.device) -> bool:
    """Whether all-gathers on ``group`` for tensors on ``device`` exchange the shards in place
    (gloo: faster than its all-gather, above) rather than use the backend's all-gather."""
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
    by_exchange: bool,
    own_in_full: bool = True,
) -> list[dist.Work]:
    """Starts filling the 1-D ``full`` with every rank's shard (rank r's at ``r * len(shard)``);
    ``shard`` is this rank's (it may differ from ``full`` in dtype, then it is cast, or already be
    ``full``'s own slice, then nothing is copied). With ``by_exchange`` and not
    ``own_in_full``, this rank's slice of ``full`` is left as it is (the caller reads its own
    part from ``shard``): the exchange sends straight from ``shard``. The caller waits on the
    returned works before reading ``full``."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    size = shard.numel()
    if full.numel() != size * world_size:
        raise ValueError(
            f"all-gather of {world_size} shards of {size} elements needs a full tensor of "
            f"{size * world_size}, got {full.numel()}"
        )
    if not by_exchange:
        source = shard if shard.dtype == full.dtype else shard.to(full.dtype)
        return [all_gather_flat(full, source, group)]
    own = full.narrow(0, rank * size, size)
    if not own_in_full and shard.dtype == full.dtype:
        own = shard
    elif own.data_ptr() != shard.data_ptr() or own.dtype != shard.dtype:  # not already in place
        own.copy_(shard)
    if world_size == 2:  # one all-to-all: this rank's shard to the other, the other's into place
        other = 1 - rank
        splits = [0, 0]
        splits[other] = size
        exchange = dist.all_to_all_single(
            full.narrow(0, other * size, size),
            own,
            output_split_sizes=splits,
            input_split_sizes=splits,
            group=group,
            async_op=True,
        )
        return [exchange]
    return [
        dist.broadcast(
            own if r == rank else full.narrow(0, r * size, size),
            group_src=r,
            group=group,
            async_op=True,
        )
        for r in range(world_size)
    ]
