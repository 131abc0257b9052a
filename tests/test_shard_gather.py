"""launch_all_gather on a real gloo group of 3: both collectives, dtype casts, a shard that is
already the full tensor's own slice, and the size check."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepspeed_cpp.runtime.zero.shard_gather import backend_for, launch_all_gather


def _shard_of(rank: int, size: int, seed: int) -> torch.Tensor:
    return torch.randn(size, generator=torch.Generator().manual_seed(seed + rank))


def gather_job(by_broadcast: bool, full_dtype: torch.dtype, size: int, seed: int, in_place: bool):
    rank, world = dist.get_rank(), dist.get_world_size()
    full = torch.full((size * world,), float("nan"), dtype=full_dtype)
    shard = _shard_of(rank, size, seed)
    if in_place:  # the shard already lives in the full tensor, as fp32 masters do
        full.narrow(0, rank * size, size).copy_(shard)
        shard = full.narrow(0, rank * size, size)
    for work in launch_all_gather(full, shard, dist.group.WORLD, by_broadcast=by_broadcast):
        work.wait()
    return full, backend_for(dist.group.WORLD, torch.device("cpu"))


@pytest.mark.parametrize("by_broadcast", [True, False])
@pytest.mark.parametrize(
    "full_dtype, in_place",
    [(torch.float32, False), (torch.float32, True), (torch.bfloat16, False)],
)
def test_every_rank_gets_every_shard(pool3, by_broadcast, full_dtype, in_place):
    seed = int(torch.randint(0, 2**30, (1,)))
    size = 1001  # odd: no alignment assumed
    outputs = pool3.run(gather_job, by_broadcast, full_dtype, size, seed, in_place)
    expected = torch.cat([_shard_of(r, size, seed) for r in range(3)]).to(full_dtype)
    for full, backend in outputs:
        assert backend == "gloo"
        assert torch.equal(full, expected)


def wrong_size_job():
    full = torch.empty(10)
    try:
        launch_all_gather(full, torch.empty(4), dist.group.WORLD, by_broadcast=True)
    except ValueError as error:
        return str(error)
    return "no error"


def test_full_tensor_of_the_wrong_size_is_refused(pool3):
    for message in pool3.run(wrong_size_job):
        assert message == ("all-gather of 3 shards of 4 elements needs a full tensor of 12, got 10")
