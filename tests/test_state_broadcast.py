"""comm/state_broadcast.py: rank 0's tensor dict on every rank with tensor collectives only
(nothing unpickled), against rank 0's own tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def broadcast_job(seed: int, bad: bool):
    from deepspeed_cpp.comm.state_broadcast import broadcast_tensor_dict

    rank = dist.get_rank()
    state = None
    if rank == 0:
        generator = torch.Generator().manual_seed(seed)
        shared = torch.randn(5, 3, generator=generator)
        state = {
            "odd": torch.randn(7, 11, 3, generator=generator),
            "bf16": torch.randn(13, generator=generator).bfloat16(),
            "ints": torch.randint(-9, 9, (4,), generator=generator),
            "empty": torch.empty(0, 4),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "tied.a": shared,
            "tied.b": shared.detach(),  # one storage under two names (tied weights)
            "column": torch.randn(6, 6, generator=generator).t(),  # not contiguous
        }
        if bad:
            state["step"] = 3
    try:
        got = broadcast_tensor_dict(state, 0, None, "(test)")
    except TypeError as error:
        return {"error": str(error)}
    return {
        "names": list(got),
        "tensors": {name: value.clone() for name, value in got.items()},
        "tied": got["tied.a"].data_ptr() == got["tied.b"].data_ptr(),
    }


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_gets_rank0s_tensors(pools, world):
    seed = int(torch.randint(0, 2**30, ()))
    results = pools(world).run(broadcast_job, seed, False)
    reference = results[0]["tensors"]
    for result in results[1:]:
        assert result["names"] == results[0]["names"]
        for name, tensor in reference.items():
            got = result["tensors"][name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(got, tensor), name
        assert result["tied"], "tied names arrive as one tensor"


def test_a_value_that_is_not_a_tensor_is_named_on_every_rank(pool2):
    results = pool2.run(broadcast_job, 0, True)
    for result in results:
        assert result["error"] == "(test): 'step' is a int, expected a tensor"
