"""What a resume does with the states around the weights: a load refused late leaves the engine
as it was, loss scalers of the other kind, the client state of a module-only load, a save
between two optimizer steps, and what killed or refused saves leave in the folder.

Every engine here is real (gloo, one rank: the states are per engine, not per rank); the
expected values are the saving engine's own, read before the save.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from checkpoint_training import (
    assert_same,
    build_engine,
    config,
    global_batches,
    make_model,
    param_groups,
    params_of,
    train,
)


def _engine(seed: int, cfg: dict, **kwargs):
    import deepspeed_cpp as deepspeed

    model = make_model(seed)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model), config=cfg, **kwargs
    )
    return engine


def _snapshot(engine) -> dict:
    return {
        "params": params_of(engine),
        "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
        "scaler": dict(engine.loss_scaler.state_dict()),
        "scheduler": engine.lr_scheduler.state_dict(),
        "lr": engine.get_lr(),
    }


# ---- a load refused after the weights were read ----------------------------------------------


def refused_late_job(directory: str, seed: int):
    from deepspeed_cpp.runtime.checkpoint import CheckpointMismatchError

    source = build_engine(seed, 1, 2, "fp16")  # the config's WarmupLR
    train(source, global_batches(seed, 2))
    source.save_checkpoint(directory, tag="warmup", client_state={"epoch": 7})
    cfg = config(1, 2, "fp16")
    del cfg["scheduler"]
    engine = _engine(
        seed + 1, cfg, lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    )
    train(engine, global_batches(seed + 2, 1))
    before = _snapshot(engine)
    try:
        engine.load_checkpoint(directory, tag="warmup")
        refused = "no error"
    except CheckpointMismatchError as error:
        refused = str(error)
    after_refusal = _snapshot(engine)
    _, client_state = engine.load_checkpoint(
        directory, tag="warmup", load_lr_scheduler_states=False
    )
    loaded = (params_of(engine), engine.global_steps, engine.lr_scheduler.state_dict())
    module_only = build_engine(seed + 3, 1, 2, "fp16")
    _, module_only_client_state = module_only.load_checkpoint(
        directory, tag="warmup", load_module_only=True
    )
    return {
        "saved": params_of(source),
        "refused": refused,
        "before": before,
        "after_refusal": after_refusal,
        "loaded": loaded,
        "step_lr_before": before["scheduler"],
        "client_state": client_state,
        "module_only": (params_of(module_only), module_only.global_steps),
        "module_only_client_state": module_only_client_state,
    }


def test_a_load_refused_for_its_schedule_changes_nothing(pools, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    (result,) = pools(1).run(refused_late_job, str(tmp_path), seed)
    refused = result["refused"]
    assert "lr scheduler state is a WarmupLR's" in refused, refused
    assert "this engine's scheduler is a StepLR" in refused
    assert "load_lr_scheduler_states=False" in refused and "warmup" in refused
    # Weights, counters, loss scale, schedule: all as before the refused load.
    assert_same(result["before"], result["after_refusal"], "engine after the refused load")
    params, steps, schedule = result["loaded"]
    assert_same(result["saved"], params, "weights loaded without the schedule")
    assert steps == 2
    assert schedule == result["step_lr_before"]  # the engine's own StepLR, untouched
    assert result["client_state"] == {"epoch": 7}
    # A module-only load takes the weights and returns the client state too (as DeepSpeed).
    module_params, module_steps = result["module_only"]
    assert_same(result["saved"], module_params, "module-only weights")
    assert module_steps == 0
    assert result["module_only_client_state"] == {"epoch": 7}


# ---- loss scalers of the other kind --------------------------------------------------------


def scaler_kinds_job(directory: str, seed: int):
    static_cfg = config(1, 2, "fp16")
    static_cfg["fp16"] = {"enabled": True, "loss_scale": 128}
    dynamic_cfg = config(1, 2, "fp16")  # dynamic, starting at 2 ** 10
    static = _engine(seed, static_cfg)
    train(static, global_batches(seed, 2))
    static.save_checkpoint(directory, tag="static")
    dynamic = _engine(seed, dynamic_cfg)
    train(dynamic, global_batches(seed, 2), overflow_at=1)  # its scale halves once
    dynamic.save_checkpoint(directory, tag="dynamic")

    now_dynamic = _engine(seed + 1, dynamic_cfg)
    now_dynamic.load_checkpoint(directory, tag="static")
    now_static = _engine(seed + 1, {**static_cfg, "fp16": {"enabled": True, "loss_scale": 64}})
    now_static.load_checkpoint(directory, tag="dynamic")
    return {
        "static": (params_of(static), static.loss_scaler.state_dict()),
        "dynamic": (params_of(dynamic), dynamic.loss_scaler.state_dict()),
        "now_dynamic": (params_of(now_dynamic), now_dynamic.loss_scaler.state_dict()),
        "now_static": (params_of(now_static), now_static.loss_scaler.state_dict()),
        "kinds": (type(now_dynamic.loss_scaler).__name__, type(now_static.loss_scaler).__name__),
    }


def test_loss_scalers_of_the_other_kind_keep_the_configured_kind(pools, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    (result,) = pools(1).run(scaler_kinds_job, str(tmp_path), seed)
    assert result["kinds"] == ("DynamicLossScaler", "StaticLossScaler")
    assert result["static"][1] == {"cur_scale": 128.0}
    assert result["dynamic"][1]["cur_scale"] == 2.0**9  # the overflow at step 1 halved it
    # Static into dynamic: dynamic scaling starts afresh at the saved scale.
    params, state = result["now_dynamic"]
    assert_same(result["static"][0], params, "weights of the static run")
    assert state == {"cur_scale": 128.0, "cur_iter": 0, "last_overflow_iter": -1,
                     "cur_hysteresis": 1}  # fmt: skip
    # Dynamic into static: the configured constant stays (the saved scale was a trajectory's).
    params, state = result["now_static"]
    assert_same(result["dynamic"][0], params, "weights of the dynamic run")
    assert state == {"cur_scale": 64.0}


# ---- a save between two optimizer steps ----------------------------------------------------


def mid_accumulation_job(directory: str, seed: int):
    engine = build_engine(seed, 1, 2)  # 3 micro-steps a step on one rank
    batches = global_batches(seed, 3)
    train(engine, batches[:2])
    engine.save_checkpoint(directory, tag="boundary")
    x, y = batches[2]
    for rows in (slice(0, 4), slice(4, 8)):  # two of the step's three micro-batches
        engine.backward(torch.nn.functional.mse_loss(engine(x[rows]), y[rows]))
        engine.step()
    engine.save_checkpoint(directory, tag="mid")
    results = {}
    for tag in ("mid", "boundary"):
        resumed = build_engine(seed + 1, 1, 2)
        resumed.load_checkpoint(directory, tag=tag)
        counters = (resumed.global_steps, resumed.micro_steps)
        train(resumed, batches[2:])  # a whole step: three micro-batches
        results[tag] = (counters, resumed.global_steps, params_of(resumed))
    return results


def test_a_save_between_steps_resumes_at_the_steps_first_micro_step(pools, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    (result,) = pools(1).run(mid_accumulation_job, str(tmp_path), seed)
    (counters, steps, params) = result["mid"]
    assert counters == (2, 6)  # saved at micro-step 8: back to the boundary of step 2
    assert steps == 3
    # The accumulated gradients were not saved: the step is the one from the boundary's save,
    # not a partial sum of one micro-batch divided by three.
    assert result["boundary"][0] == (2, 6) and result["boundary"][1] == 3
    assert_same(result["boundary"][2], params, "the step after the mid-step save")


# ---- what killed and refused saves leave -----------------------------------------------------


def refused_staging_job(directory: str, seed: int):
    from deepspeed_cpp.runtime.checkpoint import CheckpointSaveError

    engine = build_engine(seed, 1, 2)
    train(engine, global_batches(seed, 1))
    folder = Path(directory)
    folder.mkdir(exist_ok=True)
    (folder / "mine.partial").mkdir()
    (folder / "mine.partial" / "notes.txt").write_text("not a checkpoint")
    try:
        engine.save_checkpoint(directory, tag="mine")
        refused = "no error"
    except CheckpointSaveError as error:
        refused = str(error)
    engine.save_checkpoint(directory, tag="other")
    return refused


def test_a_partial_folder_of_someone_elses_files_is_refused_and_kept(pools, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    (refused,) = pools(1).run(refused_staging_job, str(tmp_path), seed)
    assert "mine.partial exists and holds what no save writes (notes.txt)" in refused, refused
    assert "move it away, or save under another tag" in refused
    assert (tmp_path / "mine.partial" / "notes.txt").read_text() == "not a checkpoint"
    assert (tmp_path / "latest").read_text() == "other"
    assert (tmp_path / "other" / "checkpoint_meta.json").is_file()


@pytest.mark.parametrize(
    "names",
    [
        # A MoE model's save (its expert files), killed before its metadata.
        ["layer_0_expert_3_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
         ".layer_1_expert_0_mp_rank_00_model_states.pt.tmp-4711"],
        # A pipeline's save: layer files, stage files, a later stage's shards.
        ["layer_02-model_states.pt", "mp_rank_01_model_states.pt",
         "zero_pp_rank_0_mp_rank_01_optim_states.pt", "client_state.pt"],
    ],
)  # fmt: skip
def test_killed_saves_of_moe_and_pipeline_models_are_cleared(tmp_path, names):
    from deepspeed_cpp.runtime.checkpoint.interrupted_saves import clear_interrupted_saves

    killed = tmp_path / "global_step4.partial"
    killed.mkdir()
    for name in names:
        (killed / name).write_bytes(os.urandom(64))
    kept = tmp_path / "global_step5.partial"
    kept.mkdir()
    (kept / names[0]).write_bytes(b"x")
    (kept / "my_results.csv").write_text("1,2\n")
    done = clear_interrupted_saves(tmp_path)
    assert done == [f"removed {killed} (a save that did not finish)"]
    assert not killed.exists()
    assert sorted(p.name for p in kept.iterdir()) == sorted([names[0], "my_results.csv"])


# ---- a consolidation stopped part-way ----------------------------------------------------------


def test_a_stopped_conversion_leaves_no_index_naming_a_mix(tmp_path):
    from deepspeed_cpp.utils.weight_files import write_weights_directory

    old = {f"w{i}": torch.randn(1000) for i in range(3)}
    new = {f"w{i}": torch.randn(1000) for i in range(3)}
    first = write_weights_directory(old, tmp_path, max_shard_size=4000)
    shards = [name for name in first.files if name.endswith(".bin")]
    index_file = "pytorch_model.bin.index.json"
    assert len(shards) == 3 and index_file in first.files
    # The second shard cannot be written (a folder holds its name): the run stops after the
    # first new shard, with the old second and third still on disk.
    (tmp_path / shards[1]).unlink()
    (tmp_path / shards[1]).mkdir()
    (tmp_path / shards[1] / "x").write_text("")
    with pytest.raises(OSError):
        write_weights_directory(new, tmp_path, max_shard_size=4000)
    assert not (tmp_path / index_file).exists()  # no index: a loader finds no weights
    assert not (tmp_path / "pytorch_model.bin").exists()
    (tmp_path / shards[1] / "x").unlink()
    (tmp_path / shards[1]).rmdir()
    write_weights_directory(new, tmp_path, max_shard_size=4000)
    weight_map = json.loads((tmp_path / index_file).read_text())["weight_map"]
    for name, file_name in weight_map.items():
        loaded = torch.load(tmp_path / file_name, weights_only=True)[name]
        assert torch.equal(loaded, new[name]), name
