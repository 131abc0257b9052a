"""``deepspeed.init_distributed`` in every argument form torch's ``init_process_group`` takes,
as DeepSpeed's own test harness and users call it: ``file://`` and ``tcp://`` rendezvous with the
rank and world size as arguments (or in the URL), ``env://`` with them as arguments over the
environment; ``deepspeed.comm.destroy_process_group`` ends the group so that the next form can
initialise again in the same process.

Real processes (two spawned ranks) and real gloo groups.
"""

from __future__ import annotations

import queue

import pytest
import torch.multiprocessing as mp
from init_forms_job import run_forms
from launch_helpers import free_port

import deepspeed_cpp

WORLD = 2
# sum over ranks of (rank + 1)
EXPECTED_SUM = float(sum(r + 1 for r in range(WORLD)))


def _run(forms: list[dict], timeout_s: float = 120.0) -> dict[int, list]:
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=run_forms, args=(r, WORLD, forms, results), daemon=True)
        for r in range(WORLD)
    ]
    for process in processes:
        process.start()
    outcome = {}
    try:
        for _ in range(WORLD):
            rank, ok, value = results.get(timeout=timeout_s)
            assert ok, f"rank {rank} failed:\n{value}"
            outcome[rank] = value
    except queue.Empty:
        pytest.fail(f"init_distributed forms did not finish within {timeout_s} s: {forms}")
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return outcome


def _assert_every_form_met(outcome: dict[int, list], forms: list[dict]) -> None:
    for rank in range(WORLD):
        assert outcome[rank] == [(rank, WORLD, EXPECTED_SUM)] * len(forms), (rank, outcome)


def test_file_and_tcp_rendezvous_take_rank_and_world_size(tmp_path):
    """DeepSpeed's harness form (``file://`` with rank/world_size arguments), then ``tcp://`` the
    same way and with both in the URL's query, one after another in the same processes."""
    forms = [
        {"kwargs": {"init_method": f"file://{tmp_path}/store", "pass_rank": True}},
        {"kwargs": {"init_method": f"tcp://127.0.0.1:{free_port()}", "pass_rank": True}},
        {"kwargs": {"init_method": f"tcp://127.0.0.1:{free_port()}?rank={{rank}}&world_size=2"}},
    ]
    _assert_every_form_met(_run(forms), forms)


def test_env_rendezvous_takes_rank_and_world_size_as_arguments():
    """``env://`` (explicit, and by default) with only MASTER_ADDR/MASTER_PORT in the environment
    and the rank and world size as arguments."""
    forms = [
        {
            "environment": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
            "kwargs": {"init_method": "env://", "pass_rank": True},
        },
        {
            "environment": {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())},
            "kwargs": {"pass_rank": True},
        },
    ]
    _assert_every_form_met(_run(forms), forms)


def test_a_file_rendezvous_without_a_rank_names_the_missing_parameter(tmp_path):
    """torch's own message, which names the URL and the missing parameter, reaches the caller."""
    with pytest.raises(ValueError, match="rank parameter missing"):
        deepspeed_cpp.init_distributed(
            "gloo", init_method=f"file://{tmp_path}/store", verbose=False, world_size=2
        )


def test_destroy_process_group_without_a_group_is_a_no_op():
    import deepspeed_cpp.comm as ds_comm

    assert not ds_comm.is_initialized()
    ds_comm.destroy_process_group()
