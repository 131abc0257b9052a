"""Checkpoints written by real DeepSpeed (0.19.8, committed fixtures) load into deepspeed_cpp.

Each fixture (``fixtures/deepspeed_checkpoints/<name>``, written by ``make_fixtures.py``: 2 ranks,
2 AdamW steps, ZeRO 1/2/3 in fp32 and ZeRO 1 in bf16) is loaded by ``engine.load_checkpoint``
into deepspeed_cpp engines of several stages and world sizes, built from other initial weights;
2 more steps must give the losses, learning rates and weights of DeepSpeed's own resume
(``expected.json``). A DeepSpeed-named file that names any other class is refused unread.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from deepspeed_fixture_model import (
    CLIENT_STATE,
    OTHER_SEED,
    STEPS_AFTER,
    STEPS_BEFORE,
    ds_config,
    make_model,
    train,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "deepspeed_checkpoints"
# fp32: the same arithmetic as DeepSpeed's up to the order of a few sums.
FP32_TOLERANCE = 1e-6
# bf16: the weights compared are bf16, rounded from fp32 masters that agree to ~1e-7, so an
# element may round the other way: one bf16 step, 2**-8 of a value in [1, 2) relative to the
# largest element (measured: 3.4e-3 at ZeRO 1). Two steps allowed; the losses (measured: equal
# bitwise) are held to the same bound.
BF16_TOLERANCE = 2**-7


def expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def our_config(world: int, stage: int, dtype: str) -> dict:
    config = ds_config(world, stage, dtype)
    config.pop("data_types", None)  # DeepSpeed's switch to its BF16_Optimizer; ours needs none
    return config


def resume_job(directory: str, stage: int, dtype: str):
    import deepspeed_cpp as deepspeed

    world = dist.get_world_size()
    model = make_model(OTHER_SEED)  # other initial weights: the load must win
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=our_config(world, stage, dtype)
    )
    path, client_state = engine.load_checkpoint(directory)
    loaded = {"path": path, "client_state": client_state, "global_steps": engine.global_steps}
    losses, lrs = train(engine, STEPS_BEFORE, STEPS_AFTER)
    weights = {n: t.detach().float().flatten() for n, t in engine.full_module_state_dict().items()}
    return loaded, losses, lrs, engine.global_steps, weights


def _losses_per_step(losses_per_rank: list[list[float]], world: int) -> list[list[float]]:
    """DeepSpeed's 2 ranks' losses regrouped as ``world`` ranks would see them (each rank's
    loss is the mean over its rows; the fixtures' global batch splits evenly)."""
    ds_world = len(losses_per_rank)
    per = ds_world // world
    return [
        [sum(losses_per_rank[r * per + k][s] for k in range(per)) / per for s in range(STEPS_AFTER)]
        for r in range(world)
    ]


CASES = [
    # (fixture, our stage, our world size)
    ("zero1", 1, 2),
    ("zero2", 2, 2),
    ("zero3", 3, 2),
    ("zero1_bf16", 1, 2),
    ("zero1", 3, 2),  # across stages: DeepSpeed's flat groups re-cut per parameter
    ("zero3", 2, 2),
    ("zero2", 2, 1),  # another world size
    ("zero3", 1, 1),
]


@pytest.mark.parametrize("name, stage, world", CASES)
def test_deepspeed_checkpoint_resumes_as_deepspeed_does(pools, name, stage, world):
    want = expected(name)
    dtype = want["dtype"]
    tolerance = BF16_TOLERANCE if dtype == "bf16" else FP32_TOLERANCE
    results = pools(world).run(resume_job, str(FIXTURES / name), stage, dtype)
    want_losses = _losses_per_step(want["losses_after_resume"], world)
    for rank, (loaded, losses, lrs, global_steps, _weights) in enumerate(results):
        assert loaded["path"] == str(FIXTURES / name / want["tag"])
        assert loaded["client_state"] == CLIENT_STATE
        assert loaded["global_steps"] == STEPS_BEFORE
        assert lrs == pytest.approx(want["lrs_after_resume"], rel=1e-12)
        assert global_steps == want["global_steps_after_resume"]
        assert losses == pytest.approx(want_losses[rank], rel=tolerance, abs=tolerance), rank
    # Weights after the 2 steps, relative to each tensor's largest element.
    for tensor_name, values in want["weights_after_resume"].items():
        reference = torch.tensor(values)
        scale = reference.abs().max().item()
        worst = (results[0][4][tensor_name] - reference).abs().max().item() / scale
        assert worst <= (tolerance if world == 2 else 1e-5), (tensor_name, worst)


# ---- refused: files that name anything but what DeepSpeed's files hold -----------------------


class _RunsShell:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_copy(tmp_path: Path, fixture: str, file: str, marker: Path) -> Path:
    """A copy of ``fixture`` whose ``file`` also holds an object that runs a shell command."""
    copy = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, copy)
    target = copy / "global_step2" / file
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import load_deepspeed_file

    # A model-states file is plain data once read; an optimizer-states file is written anew (what
    # it held would be saved back as this package's stand-ins, themselves refused).
    payload = load_deepspeed_file(target) if "model_states" in file else {"ds_version": "0.19.8"}
    payload["extra"] = _RunsShell(marker)
    target.unlink()
    torch.save(payload, target)
    return copy


HOSTILE = [
    ("zero2", "mp_rank_00_model_states.pt"),
    ("zero3", "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
]


@pytest.mark.parametrize("fixture, file", HOSTILE)
def test_foreign_class_is_refused_by_name(tmp_path, fixture, file):
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import load_deepspeed_file
    from deepspeed_cpp.runtime.checkpoint.errors import UnsafeCheckpointError

    marker = tmp_path / "ran"
    copy = _hostile_copy(tmp_path, fixture, file, marker)
    with pytest.raises(UnsafeCheckpointError, match=r"names posix\.system, which is not among"):
        load_deepspeed_file(copy / "global_step2" / file)
    assert not marker.exists()


def refused_load_job(directory: str, marker: str):
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.runtime.checkpoint.errors import IncompleteCheckpointError

    model = make_model(OTHER_SEED)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=our_config(2, 2, "fp32")
    )
    before = {n: t.clone() for n, t in engine.module.state_dict().items()}
    try:
        engine.load_checkpoint(directory)
    except IncompleteCheckpointError as error:  # UnsafeCheckpointError is one
        message = str(error)
    else:
        message = None
    unchanged = all(torch.equal(t, before[n]) for n, t in engine.module.state_dict().items())
    return message, unchanged, Path(marker).exists(), engine.global_steps


def test_engine_refuses_hostile_deepspeed_checkpoint_and_changes_nothing(pools, tmp_path):
    marker = tmp_path / "ran"
    copy = _hostile_copy(tmp_path, "zero2", "zero_pp_rank_1_mp_rank_00_optim_states.pt", marker)
    results = pools(2).run(refused_load_job, str(copy), str(marker))
    for message, unchanged, ran, global_steps in results:
        assert message is not None and "posix.system" in message, message
        assert unchanged and not ran and global_steps == 0


def test_admitted_classes_are_the_documented_ones():
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import restricted_load

    for name in restricted_load.ADMITTED:
        assert name in restricted_load.__doc__
