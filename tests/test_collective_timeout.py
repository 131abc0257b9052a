"""A rank that stops responding: the other fails within the timeout, naming the collective and
the silent rank; through the launcher the run exits non-zero with that message.

Real processes and real gloo: rank 1 sends itself SIGSTOP in the forward of step 3 of a ZeRO-2
training (tests/stalled_rank_job.py); rank 0 then waits in that step's gradient reduction. The
other collectives (initialize's broadcasts, ZeRO-3 fetches, MoE all_to_all) are covered in one
pair of processes, a process group per stall (tests/named_timeout_scenarios.py).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from launch_helpers import free_port, launch_env

from deepspeed_cpp.comm.distributed import _resolve_timeout

PYTHON = sys.executable
JOB = str(Path(__file__).parent / "stalled_rank_job.py")
SCENARIOS = str(Path(__file__).parent / "named_timeout_scenarios.py")
# The timeouts are what these tests wait for: as short as the healthy ranks' own collectives
# (tiny models, ops already loaded) allow on 2 shared cores.
TIMEOUT_S = 3
# From the stop to rank 0's raise, beyond the timeout: the grace period in which peers report
# (timeout / 4, at most 3 s) and the rest of the step, on 2 cores shared with other work.
MARGIN_S = 12

if not hasattr(signal, "SIGSTOP"):
    pytest.skip("SIGSTOP is POSIX only", allow_module_level=True)


def _assert_named(output: str, timeout_s: float = TIMEOUT_S) -> None:
    assert "CollectiveTimeoutError" in output, output[-4000:]
    assert "failed on rank 0 of 2: rank(s) 1 did not answer" in output, output[-4000:]
    assert f"within the timeout of {timeout_s:g} s" in output, output[-4000:]


def test_launcher_exits_nonzero_with_the_named_timeout(tmp_path):
    """SIGSTOP of rank 1 in a ZeRO-2 forward: rank 0 raises within the timeout, in the gradient
    reduction, and the launcher exits non-zero with that message."""
    run = subprocess.run(
        [PYTHON, "-m", "deepspeed_cpp.launcher", "--num_procs", "2", "--master_port",
         str(free_port()), "--no_local_rank", JOB, str(tmp_path), str(TIMEOUT_S), "2"],
        env=launch_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = run.stdout + run.stderr
    assert run.returncode != 0, output[-4000:]
    _assert_named(output)
    assert "GradientReducer: the " in output and "of gradient bucket " in output, output[-4000:]
    stopped = float((tmp_path / "stopped_at").read_text())
    raised = float((tmp_path / "raised_at").read_text())
    assert raised - stopped < TIMEOUT_S + MARGIN_S, (raised - stopped, output[-4000:])


def _run_scenarios(out: Path, world: int, timeout_s: float, *arguments: str) -> dict:
    """Runs named_timeout_scenarios.py in ``world`` processes; its errors.json."""
    port, processes = free_port(), []
    for rank in range(world):
        env = launch_env()  # drops launcher variables: set this world's after it
        env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
        log = open(out / f"rank{rank}.log", "w")
        processes.append(subprocess.Popen(
            [PYTHON, SCENARIOS, str(out), str(timeout_s), *arguments], env=env, stdout=log,
            stderr=log,
        ))  # fmt: skip
    try:
        codes = [process.wait(timeout=400) for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(world))
    assert codes == [0] * world, logs
    return json.loads((out / "errors.json").read_text())


def test_each_engine_collective_is_named(tmp_path):
    """Rank 1 stops answering in initialize(), before a ZeRO-3 parameter gather
    (GatheredParameters), in an expert-parallel MoE forward (all_to_all) and as pipeline stage 1
    in the middle of a batch; rank 0's error names each of those collectives."""
    timeout_s = 2  # every op is loaded by the scenarios' warm-up run before the first stall
    errors = _run_scenarios(tmp_path, 2, timeout_s)
    expected = {
        # initialize()'s first collective: the ranks' agreement on their set-up.
        "initialize": "all_gather of the set-up digests at deepspeed_cpp.initialize() ",
        "zero3_gather": "all_gather (fetch) of ZeRO-3 parameter ",
        "moe_all_to_all": "all_to_all of MoE tokens (shape [",
        # A pipeline stage that stops mid-schedule: its neighbour's point-to-point wait.
        "pipeline_stage": "receive of activation gradients (tensor 0 of shape [4, 16]) from rank 1",
    }
    for name, label in expected.items():
        error = errors[name]["0"]
        _assert_named(error, timeout_s)
        assert error.startswith(f"CollectiveTimeoutError: {label}"), (name, error)


def test_four_ranks_name_the_one_stalled_in_a_zero3_gather(tmp_path):
    """4 ranks, rank 2 stops answering before a ZeRO-3 parameter gather: each of the 3 healthy
    ranks names the gather and rank 2 alone (each of them reported its own failure)."""
    timeout_s = 6  # a grace of 1.5 s for the healthy ranks' reports, 4 processes on 2 cores
    errors = _run_scenarios(tmp_path, 4, timeout_s, "2", "zero3_gather")["zero3_gather"]
    assert sorted(errors) == ["0", "1", "3"], errors
    for rank, error in errors.items():
        assert error.startswith(
            "CollectiveTimeoutError: all_gather (fetch) of ZeRO-3 parameter "
        ), error
        assert f"failed on rank {rank} of 4: rank(s) 2 did not answer" in error, error
        assert f"within the timeout of {timeout_s:g} s" in error, error


def test_timeout_from_argument_or_deepspeed_timeout(monkeypatch):
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    assert _resolve_timeout(None) is None
    assert _resolve_timeout(8) == timedelta(seconds=8)
    assert _resolve_timeout(timedelta(minutes=2)) == timedelta(minutes=2)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "0.5")  # DeepSpeed's variable is in minutes
    assert _resolve_timeout(None) == timedelta(seconds=30)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "ten")
    with pytest.raises(ValueError, match="DEEPSPEED_TIMEOUT must be a number of minutes"):
        _resolve_timeout(None)
    for bad in (0, -1, "8", True):
        with pytest.raises(ValueError, match="timeout must be a positive timedelta"):
            _resolve_timeout(bad)


def test_usage_errors_keep_their_own_message():
    """Only a peer's silence is reworded; other failures inside a wrapped wait pass through."""
    from deepspeed_cpp.comm.collective_errors import named_collective

    with pytest.raises(RuntimeError, match="^size mismatch$"):
        with named_collective("all_gather of parameter bucket 0 of 1"):
            raise RuntimeError("size mismatch")
