"""launch_all_gather on real gloo groups of 2 and 3: the backend's all-gather and the in-place
exchange (one all-to-all between 2 ranks, one broadcast per rank among 3), dtype casts, a shard
that is already the full tensor's own slice, one sent from elsewhere with the own slice left
alone, and the size check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepspeed_cpp.runtime.zero.shard_gather import backend_for, launch_all_gather


def _shard_of(rank: int, size: int, seed: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed + rank))


def gather_job(
    by_exchange: bool, full_dtype: torch.dtype, size: int, seed: int, where: str
) -> tuple:
    """``where`` the shard is: "apart" (a tensor of its own), "in_place" (the full tensor's own
    slice, as fp32 masters are) or "own_left" (apart, and ``own_in_full=False``)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.full((size * world,), float("nan"), dtype=full_dtype)
    shard = _shard_of(rank, size, seed)
    if where == "in_place":
        full.narrow(0, rank * size, size).copy_(shard)
        shard = full.narrow(0, rank * size, size)
    works = launch_all_gather(
        full, shard, dist.group.WORLD, by_exchange=by_exchange, own_in_full=where != "own_left"
    )
    for work in works:
        work.wait()
    return full, backend_for(dist.group.WORLD, torch.device("cpu")), len(works)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("by_exchange", [True, False])
@pytest.mark.parametrize(
    "full_dtype, where",
    [
        (torch.float32, "apart"),
        (torch.float32, "in_place"),
        (torch.bfloat16, "apart"),
        (torch.float32, "own_left"),
    ],
)
def test_every_rank_gets_every_shard(pools, world, by_exchange, full_dtype, where):
    seed = int(torch.randint(0, 2**30, (1,)))
    size = 1001  # odd: no alignment assumed
    outputs = pools(world).run(gather_job, by_exchange, full_dtype, size, seed, where)
    shards = [_shard_of(r, size, seed).to(full_dtype) for r in range(world)]
    for rank, (full, backend, collectives) in enumerate(outputs):
        assert backend == "gloo"
        expected = list(shards)
        if where == "own_left" and by_exchange:  # this rank's slice is not written
            expected[rank] = torch.full((size,), float("nan"), dtype=full_dtype)
        assert torch.equal(full.nan_to_num(7.0), torch.cat(expected).nan_to_num(7.0))
        # One collective for the backend's all-gather and the pair's all-to-all; one broadcast
        # per rank among 3.
        assert collectives == (world if by_exchange and world > 2 else 1)


def wrong_size_job():
    full = torch.empty(10)
    try:
        launch_all_gather(full, torch.empty(4), dist.group.WORLD, by_exchange=True)
    except ValueError as error:
        return str(error)
    return "no error"


def test_full_tensor_of_the_wrong_size_is_refused(pool3):
    for message in pool3.run(wrong_size_job):
        assert message == ("all-gather of 3 shards of 4 elements needs a full tensor of 12, got 10")
