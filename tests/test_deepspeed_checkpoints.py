"""Checkpoints written by real DeepSpeed (0.19.8, committed fixtures) load into deepspeed_cpp.

Each fixture (``fixtures/deepspeed_checkpoints/<name>``, written by ``make_fixtures.py``: 2 ranks,
2 AdamW steps, ZeRO 1/2/3 in fp32, ZeRO 1 in bf16, ZeRO 2 in fp16 with its dynamic loss scaler,
ZeRO 3 with a frozen parameter) is loaded by ``engine.load_checkpoint``
into deepspeed_cpp engines of several stages and world sizes, built from other initial weights;
2 more steps must give the losses, learning rates and weights of DeepSpeed's own resume
(``expected.json``). A DeepSpeed-named file that names any other class is refused unread.
"""

from __future__ import annotations

import json
import os
import re
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
# fp16: the weights compared are fp16 (2**-11 relative steps), the losses fp32 sums of them.
TOLERANCES = {"fp32": FP32_TOLERANCE, "bf16": BF16_TOLERANCE, "fp16": 2**-10}


def expected(name: str) -> dict:
    return json.loads((FIXTURES / name / "expected.json").read_text())


def our_config(world: int, stage: int, dtype: str) -> dict:
    config = ds_config(world, stage, dtype)
    config.pop("data_types", None)  # DeepSpeed's switch to its BF16_Optimizer; ours needs none
    return config


def build_ours(stage: int, dtype: str, frozen: bool):
    import deepspeed_cpp as deepspeed

    model = make_model(OTHER_SEED, frozen)  # other initial weights: the load must win
    trainable = [p for p in model.parameters() if p.requires_grad]
    config = our_config(dist.get_world_size(), stage, dtype)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    return engine


def resume_job(directory: str, stage: int, dtype: str):
    engine = build_ours(stage, dtype, directory.endswith("_frozen"))
    path, client_state = engine.load_checkpoint(directory)
    scaler = engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None
    loaded = {"path": path, "client_state": client_state, "global_steps": engine.global_steps,
              "loss_scaler": scaler}  # fmt: skip
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
    ("zero2_fp16", 2, 2),
    ("zero2_fp16", 3, 2),
    ("zero3_frozen", 3, 2),
    ("zero3_frozen", 1, 1),
]


def _saved_scaler(name: str):
    """The loss scaler DeepSpeed saved (read here by the restricted unpickler), or None."""
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import load_deepspeed_file

    if expected(name)["dtype"] != "fp16":
        return None
    path = FIXTURES / name / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    return load_deepspeed_file(path)["optimizer_state_dict"]["loss_scaler"].__dict__


@pytest.mark.parametrize("name, stage, world", CASES)
def test_deepspeed_checkpoint_resumes_as_deepspeed_does(pools, name, stage, world):
    want = expected(name)
    dtype = want["dtype"]
    tolerance = TOLERANCES[dtype]
    results = pools(world).run(resume_job, str(FIXTURES / name), stage, dtype)
    scaler = _saved_scaler(name)
    want_losses = _losses_per_step(want["losses_after_resume"], world)
    for rank, (loaded, losses, lrs, global_steps, _weights) in enumerate(results):
        assert loaded["path"] == str(FIXTURES / name / want["tag"])
        assert loaded["client_state"] == CLIENT_STATE
        assert loaded["global_steps"] == STEPS_BEFORE
        if scaler is not None:  # DeepSpeed's dynamic scaler state, carried over
            for key, value in loaded["loss_scaler"].items():
                assert value == scaler[key], (key, value, scaler[key])
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


# ---- converted once (python -m deepspeed_cpp.checkpoint.convert) -----------------------------


def direct_and_converted_job(original: str, converted: str, stage: int, dtype: str):
    """Two engines from the same other weights: one loads the DeepSpeed folder, one the
    converted folder; both train STEPS_AFTER steps. Returns what must be bitwise equal."""

    runs = []
    for directory in (original, converted):
        engine = build_ours(stage, dtype, original.endswith("_frozen"))
        _path, client_state = engine.load_checkpoint(directory)
        loaded = {n: t.detach().clone() for n, t in engine.full_module_state_dict().items()}
        losses, lrs = train(engine, STEPS_BEFORE, STEPS_AFTER)
        after = {n: t.detach().clone() for n, t in engine.full_module_state_dict().items()}
        runs.append((client_state, engine.global_steps, loaded, losses, lrs, after))
    (cs_a, steps_a, loaded_a, losses_a, lrs_a, after_a), second = runs[0], runs[1]
    cs_b, steps_b, loaded_b, losses_b, lrs_b, after_b = second
    same = lambda x, y: x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)  # noqa: E731
    return {
        "client_state": cs_a == cs_b == CLIENT_STATE,
        "steps": steps_a == steps_b == STEPS_BEFORE + STEPS_AFTER,
        "loaded": same(loaded_a, loaded_b),
        "losses": losses_a == losses_b,
        "lrs": lrs_a == lrs_b,
        "after": same(after_a, after_b),
    }


# (fixture, our stage): each DeepSpeed layout once, loaded at another stage where it can be.
CONVERT_CASES = [("zero1_bf16", 1), ("zero2", 3), ("zero3", 2), ("zero2_fp16", 2),
                 ("zero3_frozen", 3)]  # fmt: skip


@pytest.mark.parametrize("name, stage", CONVERT_CASES)
def test_converted_checkpoint_resumes_bitwise_as_the_deepspeed_folder(pools, tmp_path, name, stage):
    from deepspeed_cpp.checkpoint.convert import main

    destination = tmp_path / "converted"
    assert main([str(FIXTURES / name), str(destination)]) == 0
    tag = expected(name)["tag"]
    assert (destination / "latest").read_text() == tag
    assert (destination / tag / "checkpoint_meta.json").is_file()  # our layout, read by ours
    assert not any(p.name.startswith("bf16_") for p in (destination / tag).iterdir())
    result = pools(2).run(
        direct_and_converted_job, str(FIXTURES / name), str(destination), stage,
        expected(name)["dtype"],
    )  # fmt: skip
    for rank_result in result:
        assert all(rank_result.values()), rank_result


def test_converted_checkpoint_consolidates_like_the_deepspeed_one(tmp_path):
    """zero_to_fp32 reads the converted folder: the fp32 weights are DeepSpeed's masters."""
    from deepspeed_cpp.checkpoint.convert import convert_deepspeed_checkpoint
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import read_deepspeed_checkpoint
    from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    convert_deepspeed_checkpoint(FIXTURES / "zero3", tmp_path / "out")
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "out")
    saved = read_deepspeed_checkpoint(FIXTURES / "zero3" / "global_step2", False, True)
    assert consolidated.keys() == saved.module_state.keys()
    for name, value in saved.module_state.items():
        assert torch.equal(consolidated[name], value.float()), name


def test_convert_refuses_bad_input_by_name(tmp_path, capsys):
    from deepspeed_cpp.checkpoint.convert import main

    not_deepspeed = tmp_path / "empty"
    not_deepspeed.mkdir()
    assert main([str(not_deepspeed), str(tmp_path / "a")]) == 2
    assert f"{not_deepspeed} is not a DeepSpeed checkpoint" in capsys.readouterr().err
    assert main([str(tmp_path / "missing"), str(tmp_path / "a")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert main([str(FIXTURES / "zero2"), str(taken)]) == 2
    assert f"destination {taken} exists and is not empty" in capsys.readouterr().err
    assert sorted(p.name for p in taken.iterdir()) == ["keep.txt"]
    assert main([str(FIXTURES / "zero2"), str(tmp_path / "b"), "--tag", "global_step9"]) == 2
    assert "global_step9 is not a DeepSpeed checkpoint: it does not exist" in (
        capsys.readouterr().err
    )
    # Our own layout is not DeepSpeed's: converting a converted folder is refused by name.
    assert main([str(FIXTURES / "zero2"), str(tmp_path / "c")]) == 0
    assert main([str(tmp_path / "c"), str(tmp_path / "d")]) == 2
    assert "already a deepspeed_cpp checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "d").exists()


_UNANNOUNCED = "is not one of the expert files its model states announce"


@pytest.mark.parametrize(
    "extra, message",
    [
        ("mp_rank_01_model_states.pt", "with model \\(tensor or pipeline\\) parallel ranks"),
        ("zero_pp_rank_0_mp_rank_01_optim_states.pt", "with model \\(tensor or pipeline\\)"),
        # An expert file beside a model without MoE layers, and DeepSpeed's older expert name.
        ("layer_0_expert_1_mp_rank_00_model_states.pt", _UNANNOUNCED),
        ("expert_0_mp_rank_00_model_states.pt", _UNANNOUNCED),
    ],
)
def test_model_parallel_and_stray_expert_files_are_refused_by_name(tmp_path, extra, message):
    from deepspeed_cpp.runtime.checkpoint.deepspeed_format import read_deepspeed_checkpoint
    from deepspeed_cpp.runtime.checkpoint.errors import CheckpointMismatchError

    copy = tmp_path / "zero2"
    shutil.copytree(FIXTURES / "zero2", copy)
    shutil.copy(copy / "global_step2" / "mp_rank_00_model_states.pt", copy / "global_step2" / extra)
    with pytest.raises(CheckpointMismatchError, match=f"{extra}|{message}") as refused:
        read_deepspeed_checkpoint(copy / "global_step2", False, True)
    assert extra in str(refused.value) and re.search(message, str(refused.value))
