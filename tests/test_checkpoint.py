"""engine.save_checkpoint / load_checkpoint on real gloo groups of 1, 2 and 3 processes.

Resharding is checked against an independent reference: one process training the same model on
the same global batches with torch.optim.AdamW, uninterrupted. A run that trains, saves at N
ranks, loads at M ranks (another ZeRO stage too) and trains on must match it to 1e-6.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import socket
import time
from datetime import timedelta
from pathlib import Path

import numpy
import pytest
import torch
import torch.distributed as dist
from checkpoint_training import (
    GAS,
    HIDDEN,
    assert_same,
    build_engine,
    config,
    global_batches,
    lr_at,
    make_model,
    max_relative_difference,
    param_groups,
    params_of,
    reference,
    reference_tolerance,
    tensors_in,
    train,
)

# ---- jobs (run on every rank of a pool) ------------------------------------------------------


def train_and_save_job(directory: str, stage: int, model_seed: int, data_seed: int, steps: int):
    world = dist.get_world_size()
    engine = build_engine(model_seed, world, stage)
    train(engine, global_batches(data_seed, steps))
    engine.save_checkpoint(directory, client_state={"world": world})
    return params_of(engine)


def load_and_train_job(directory: str, stage: int, data_seed: int, steps_done: int, steps: int):
    world = dist.get_world_size()
    engine = build_engine(12345, world, stage)  # other initial weights: the load must win
    path, client_state = engine.load_checkpoint(directory)
    loaded = {"path": path, "client_state": client_state, "global_steps": engine.global_steps,
              "lr": engine.get_lr(), "params": params_of(engine)}  # fmt: skip
    train(engine, global_batches(data_seed, steps_done + steps)[steps_done:])
    return loaded, params_of(engine), engine.global_steps, engine.micro_steps


# ---- resharding ----------------------------------------------------------------------------

RESHARD_CASES = [
    # (saved world, saved stage, loading world, loading stage)
    *[(n, s, m, s) for s in (0, 1, 2) for n, m in ((2, 1), (2, 3), (3, 2))],
    (2, 1, 3, 2),  # across stages: the layout is rebuilt per parameter
    (3, 2, 1, 0),
    (1, 0, 2, 1),  # (and 3 accumulation steps to 2: the micro-step count is re-based)
]


@pytest.mark.parametrize("saved_world, saved_stage, world, stage", RESHARD_CASES)
def test_reshard_continues_as_uninterrupted_run(
    pools, tmp_path, saved_world, saved_stage, world, stage
):
    model_seed, data_seed = (int(v) for v in torch.randint(0, 2**30, (2,)))
    before, after = 3, 2
    saved = pools(saved_world).run(
        train_and_save_job, str(tmp_path), saved_stage, model_seed, data_seed, before
    )[0]
    results = pools(world).run(load_and_train_job, str(tmp_path), stage, data_seed, before, after)
    worlds_saved, worlds = [saved_world] * before, [saved_world] * before + [world] * after
    expected_saved = reference(model_seed, data_seed, worlds_saved)
    expected = reference(model_seed, data_seed, worlds)
    assert max_relative_difference(saved, expected_saved) <= reference_tolerance(worlds_saved)
    for loaded, final, global_steps, micro_steps in results:
        assert loaded["path"] == str(tmp_path / f"global_step{before}")
        assert loaded["client_state"] == {"world": saved_world}
        assert loaded["global_steps"] == before
        assert loaded["lr"] == pytest.approx([lr_at(before)] * 2, rel=1e-12)
        for name, tensor in saved.items():
            assert torch.equal(loaded["params"][name], tensor), name
        assert global_steps == before + after and micro_steps == (before + after) * GAS[world]
        for name, tensor in results[0][1].items():
            assert torch.equal(final[name], tensor), f"ranks disagree on {name}"
    assert max_relative_difference(results[0][1], expected) <= reference_tolerance(worlds)
    # The comparison can fail: one step fewer is far away.
    assert max_relative_difference(results[0][1], expected_saved) > 1e-3


# ---- round trip: everything comes back -------------------------------------------------------


def _shard_snapshot(engine) -> list[dict]:
    return [
        {"master": s["master"].clone(),
         "state": {k: v.clone() if torch.is_tensor(v) else v for k, v in s["state"].items()}}
        for s in engine.optimizer.shard_state()
    ]  # fmt: skip


def _snapshot(engine) -> dict:
    return {
        "params": params_of(engine),
        "shards": _shard_snapshot(engine),
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
        ],
        "scheduler": engine.lr_scheduler.state_dict(),
        "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler is not None else None,
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps,
                     engine.skipped_steps, engine.optimizer.skipped_steps),
    }  # fmt: skip


def _draws() -> tuple:
    return torch.rand(4), random.random(), float(numpy.random.rand())


def round_trip_job(directory: str, stage: int, dtype: str, seed: int):
    world = dist.get_world_size()
    original = build_engine(seed, world, stage, dtype)
    torch.manual_seed(seed + dist.get_rank())  # a different CPU generator state on each rank
    train(original, global_batches(seed, 4), overflow_at=1 if dtype == "fp16" else None)
    client_state = {"epoch": 7, "note": "resume", "best": torch.arange(3.0)}
    original.save_checkpoint(directory, tag="round_trip", client_state=client_state)
    saved = _snapshot(original)
    draws_after_save = _draws()

    other = build_engine(seed + 1, world, stage, dtype)
    train(other, global_batches(seed + 1, 1))  # some state of its own, to be overwritten
    path, loaded_client_state = other.load_checkpoint(directory, tag="round_trip")
    loaded = _snapshot(other)
    draws_after_load = _draws()

    # Both continue on the same batches: they must stay bitwise identical.
    batches = global_batches(seed + 2, 2)
    train(original, batches)
    train(other, batches)
    return {
        "saved": saved,
        "loaded": loaded,
        "draws": (draws_after_save, draws_after_load),
        "client_state": loaded_client_state,
        "path": path,
        "continued": (params_of(original), params_of(other)),
    }


@pytest.mark.parametrize(
    "stage, dtype", [(0, "fp16"), (1, "fp16"), (2, "fp16"), (2, "bf16"), (2, "fp32")]
)
def test_round_trip_restores_everything(pools, tmp_path, stage, dtype):
    seed = int(torch.randint(0, 2**30, (1,)))
    results = pools(2).run(round_trip_job, str(tmp_path), stage, dtype, seed)
    for rank, result in enumerate(results):
        saved, loaded = result["saved"], result["loaded"]
        assert result["path"] == str(tmp_path / "round_trip")
        assert_same(saved, loaded, f"rank {rank}")
        assert saved["shards"][0]["state"], "the optimizer has state to restore"
        if dtype == "fp16":
            assert saved["counters"][3] == 1, "the injected overflow skipped one step"
            assert saved["scaler"]["cur_scale"] == 2.0**9
        assert saved["scheduler"]["last_batch_iteration"] == 3 - saved["counters"][3]
        assert_same(result["draws"][0], result["draws"][1], f"rank {rank} RNG draws")
        expected_client_state = {"epoch": 7, "note": "resume", "best": torch.arange(3.0)}
        assert_same(result["client_state"], expected_client_state, "client_state")
        assert_same(result["continued"][0], result["continued"][1], f"rank {rank} continued")
        # fp32 master slices view the flat parameters; torch.save would write a view's whole
        # storage: the shard file holds each slice alone.
        from deepspeed_cpp.runtime.checkpoint.layout import optimizer_shard_file

        shard_file = torch.load(tmp_path / "round_trip" / optimizer_shard_file(rank))
        for tensor in tensors_in(shard_file):
            assert tensor.untyped_storage().nbytes() == tensor.nbytes
    # Different seeds per rank: the restored RNG states are each rank's own.
    assert not torch.equal(results[0]["draws"][0][0], results[1]["draws"][0][0])


# ---- a crash part-way through a save -----------------------------------------------------------


def _fail_after_rank0_shard(staging, rank):
    from deepspeed_cpp.runtime.checkpoint.layout import optimizer_shard_file

    if rank != 1:
        return
    deadline = time.monotonic() + 60
    while not (staging / optimizer_shard_file(0)).exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never wrote its shard")
        time.sleep(0.01)
    raise OSError(28, "No space left on device (injected)")


def crash_job(directory: str, seed: int):
    from deepspeed_cpp.runtime.checkpoint import (
        CheckpointNotFoundError,
        CheckpointSaveError,
        saver,
    )

    engine = build_engine(seed, dist.get_world_size(), 2)
    batches = global_batches(seed, 3)
    train(engine, batches[:2])
    engine.save_checkpoint(directory, tag="good")
    good = params_of(engine)
    train(engine, batches[2:])
    saver.before_rank_files = _fail_after_rank0_shard
    try:
        engine.save_checkpoint(directory, tag="bad")
        error = "no error"
    except CheckpointSaveError as caught:
        error = str(caught)
    finally:
        saver.before_rank_files = None
    dist.barrier()
    latest = (Path(directory) / "latest").read_text()
    staging_left = (Path(directory) / "bad.partial").exists()
    try:
        engine.load_checkpoint(directory, tag="bad")
        bad_load = "no error"
    except CheckpointNotFoundError as caught:
        bad_load = str(caught)
    path, _ = engine.load_checkpoint(directory)
    restored = params_of(engine)
    engine.save_checkpoint(directory, tag="bad")  # a later save of the tag cleans up and works
    return error, latest, staging_left, bad_load, path, good, restored


def test_crash_between_shard_writes_leaves_latest_at_previous(pools, tmp_path):
    results = pools(2).run(crash_job, str(tmp_path), int(torch.randint(0, 2**30, (1,))))
    for error, latest, staging_left, bad_load, path, good, restored in results:
        assert "failed on 1 rank(s): rank 1: OSError" in error and "No space left" in error
        assert "still names 'good'" in error
        assert latest == "good"
        assert not staging_left  # the failed save removed its <tag>.partial before raising
        assert "bad does not exist" in bad_load and "bad.partial" not in bad_load
        assert "complete checkpoints in" in bad_load and "['good']" in bad_load
        assert path == str(tmp_path / "good")
        assert_same(good, restored, "restored")
    assert (tmp_path / "latest").read_text() == "bad"
    assert not (tmp_path / "bad.partial").exists()
    assert (tmp_path / "bad" / "checkpoint_meta.json").is_file()


def _die_after_rank0_shard(staging, rank):
    if rank == 1:
        deadline = time.monotonic() + 60
        while not (staging / "zero_pp_rank_0_mp_rank_00_optim_states.pt").exists():
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        os._exit(17)  # no exception handling, no cleanup: the process is gone


def hard_crash_worker(rank: int, port: int, directory: str, seed: int, result_file: str):
    from deepspeed_cpp.runtime.checkpoint import saver

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    engine = build_engine(seed, 2, 1)
    batches = global_batches(seed, 3)
    train(engine, batches[:2])
    engine.save_checkpoint(directory, tag="good")
    good = params_of(engine)
    train(engine, batches[2:])
    saver.before_rank_files = _die_after_rank0_shard
    try:
        engine.save_checkpoint(directory, tag="bad")
        outcome = "saved"
    except Exception as error:  # noqa: BLE001 - whatever the dead peer makes gloo raise
        outcome = f"{type(error).__name__}: {error}"
    torch.save({"outcome": outcome, "good": good}, result_file)
    os._exit(0)  # the group has lost a member: skip its teardown


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_process_killed_mid_save_leaves_latest_at_previous(tmp_path):
    from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    seed = int(torch.randint(0, 2**30, (1,)))
    result_file = tmp_path / "rank0.pt"
    context = torch.multiprocessing.start_processes(
        hard_crash_worker,
        args=(_free_port(), str(tmp_path / "ckpt"), seed, str(result_file)),
        nprocs=2, join=False, start_method="spawn",
    )  # fmt: skip
    for process in context.processes:
        process.join(timeout=180)
    assert [p.exitcode for p in context.processes] == [0, 17]
    result = torch.load(result_file, weights_only=True)
    assert result["outcome"] != "saved"
    assert (tmp_path / "ckpt" / "latest").read_text() == "good"
    assert not (tmp_path / "ckpt" / "bad").exists()
    # The surviving rank 0, which holds the save lock, removed the failed save's staging folder.
    assert not (tmp_path / "ckpt" / "bad.partial").exists()
    # The previous checkpoint is whole: consolidating it (no engine) gives the weights it saved.
    consolidated = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "ckpt")
    assert_same(consolidated, result["good"], "good checkpoint")


# ---- missing, incomplete and mismatching checkpoints -------------------------------------------


class RunsCode:
    """Unpickling it creates the file ``marker``: what a hostile checkpoint would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def errors_job(directory: str, seed: int):
    from deepspeed_cpp.runtime.checkpoint import (
        CheckpointMismatchError,
        CheckpointNotFoundError,
        CheckpointSaveError,
        IncompleteCheckpointError,
    )

    messages = {}

    def attempt(key, make_engine, *args, **kwargs):
        engine = make_engine()
        try:
            outcome = engine.load_checkpoint(*args, **kwargs)
        except (CheckpointMismatchError, CheckpointNotFoundError,
                IncompleteCheckpointError) as error:  # fmt: skip
            outcome = f"{type(error).__name__}: {error}"
        messages[key] = outcome

    def same():
        return build_engine(seed, 1, 1)

    attempt("nothing_saved", same, directory)
    saver = build_engine(seed, 1, 1)
    train(saver, global_batches(seed, 1))
    saver.save_checkpoint(directory)
    root = Path(directory)
    checkpoint = root / "global_step1"
    for damage in ("shard", "module", "meta"):
        copy = root / f"damaged_{damage}"
        shutil.copytree(checkpoint, copy)
        if damage == "shard":
            (copy / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
        elif damage == "module":
            with open(copy / "mp_rank_00_model_states.pt", "r+b") as handle:
                handle.truncate(100)
        else:
            (copy / "checkpoint_meta.json").unlink()
        attempt(f"damaged_{damage}", same, directory, tag=f"damaged_{damage}")
    # A client_state.pt whose pickle would run code (the metadata's byte count made to match):
    # refused, nothing executed.
    hostile = root / "hostile"
    shutil.copytree(checkpoint, hostile)
    torch.save(
        {"client_state": {"x": RunsCode(str(root / "code_ran"))}}, hostile / "client_state.pt"
    )
    # The attacker also rewrites the size and digests: those detect damage, not tampering.
    from deepspeed_cpp.runtime.checkpoint.digests import seal_metadata

    meta = json.loads((hostile / "checkpoint_meta.json").read_text())
    for entry in meta["files"]:
        if entry["name"] == "client_state.pt":
            entry["bytes"] = (hostile / "client_state.pt").stat().st_size
            entry["sha256"] = hashlib.sha256((hostile / "client_state.pt").read_bytes()).hexdigest()
    (hostile / "checkpoint_meta.json").write_text(json.dumps(seal_metadata(meta)))
    attempt("hostile", same, directory, tag="hostile")
    messages["code_ran"] = (root / "code_ran").exists()
    try:
        saver.save_checkpoint(directory, tag="objects", client_state={"x": RunsCode("unused")})
        messages["object_saved"] = "saved"
    except CheckpointSaveError as error:
        messages["object_saved"] = str(error)
    messages["object_tag_exists"] = (root / "objects").exists()
    attempt("no_such_tag", same, directory, tag="global_step99")
    attempt("wider", lambda: build_engine(seed, 1, 1, hidden=HIDDEN + 1), directory)
    attempt("extra_layer", lambda: build_engine(seed, 1, 1, extra_layer=True), directory)

    def with_frozen_mid():
        import deepspeed_cpp as deepspeed

        model = make_model(seed)
        model.mid.requires_grad_(False)
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model), config=config(1, 1)
        )
        return engine

    attempt("now_frozen", with_frozen_mid, directory)

    def with_sgd():
        import deepspeed_cpp as deepspeed

        model = make_model(seed)
        cfg = dict(config(1, 1), optimizer={"type": "SGD", "params": {"lr": 0.1}})
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model),
                                          config=cfg)  # fmt: skip
        return engine

    attempt("sgd", with_sgd, directory)
    attempt("sgd_weights_only", with_sgd, directory, load_optimizer_states=False)
    return messages


def test_missing_incomplete_and_mismatching_checkpoints(pools, tmp_path):
    (messages,) = pools(1).run(errors_job, str(tmp_path), int(torch.randint(0, 2**30, (1,))))
    assert messages["nothing_saved"] == (None, None)
    shard = messages["damaged_shard"]
    assert shard.startswith("IncompleteCheckpointError")
    assert "zero_pp_rank_0_mp_rank_00_optim_states.pt (shard of rank 0) is missing" in shard
    module = messages["damaged_module"]
    assert "mp_rank_00_model_states.pt (module states) has 100 bytes" in module
    meta = messages["damaged_meta"]
    assert "incomplete: checkpoint_meta.json is missing" in meta and "files present" in meta
    hostile = messages["hostile"]
    assert hostile.startswith("UnsafeCheckpointError") and "client_state.pt" in hostile
    assert "this file holds objects that are not tensors" in hostile
    assert "never unpickles such objects" in hostile and "weights_only" not in hostile
    assert messages["code_ran"] is False
    assert "client_state['x'] is a test_checkpoint.RunsCode" in messages["object_saved"]
    assert "allow_pickle=True" in messages["object_saved"]
    assert messages["object_tag_exists"] is False
    missing = messages["no_such_tag"]
    assert (
        missing.startswith("CheckpointNotFoundError") and "global_step99 does not exist" in missing
    )
    wider = messages["wider"]
    assert wider.startswith("CheckpointMismatchError")
    # The first difference in state_dict order: the module's own buffer, then its children.
    assert f"'offset': the checkpoint has shape [{HIDDEN}], the model [{HIDDEN + 1}]" in wider
    extra = messages["extra_layer"]
    assert f"the model has 'extra.weight' (shape [{HIDDEN}, {HIDDEN}])" in extra
    frozen = messages["now_frozen"]
    assert "the checkpoint trains parameter 'mid." in frozen and "this engine does not" in frozen
    sgd = messages["sgd"]
    assert "optimizer is FusedAdam, this engine's is SGD" in sgd
    assert "load_optimizer_states=False" in sgd
    assert messages["sgd_weights_only"][1] == {}


# ---- loading weights only ------------------------------------------------------------------


def module_only_job(directory: str, seed: int):
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.runtime.checkpoint import CheckpointMismatchError

    source = build_engine(seed, 1, 2)
    train(source, global_batches(seed, 2))
    source.save_checkpoint(directory)
    # DeepSpeed's engine names the file of a rank's optimizer state (its test suite reads it).
    optimizer_file = source._get_optimizer_ckpt_name(directory, f"global_step{source.global_steps}")
    engine = build_engine(seed + 1, 1, 2)
    engine.load_checkpoint(directory, load_module_only=True)
    after_load = (engine.global_steps, params_of(engine))
    train(engine, global_batches(seed + 2, 1))

    # An engine without an optimizer (inference) loads the weights, and saves its own.
    inference, *_ = deepspeed.initialize(
        model=make_model(seed + 3),
        config={"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 2},
    )
    inference.load_checkpoint(directory)
    inference_loaded = params_of(inference)
    inference.save_checkpoint(directory, tag="inference")
    try:
        build_engine(seed, 1, 2).load_checkpoint(directory, tag="inference")
        refused = "no error"
    except CheckpointMismatchError as error:
        refused = str(error)
    weights_only = build_engine(seed + 4, 1, 0)
    weights_only.load_checkpoint(directory, tag="inference", load_module_only=True)
    return {
        "saved": params_of(source),
        "after_load": after_load,
        "trained": params_of(engine),
        "inference_loaded": inference_loaded,
        "refused": refused,
        "from_inference": params_of(weights_only),
        "optimizer_file": optimizer_file,
    }


def test_load_module_only_and_engines_without_optimizer(pools, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    (result,) = pools(1).run(module_only_job, str(tmp_path), seed)
    steps, loaded = result["after_load"]
    assert steps == 0
    assert_same(result["saved"], loaded, "weights")
    # Training restarts from the loaded weights with a fresh AdamW (no state, first lr).
    expected = reference(0, seed + 2, [1], weights=loaded)
    assert max_relative_difference(result["trained"], expected) <= 1e-6
    assert_same(result["saved"], result["inference_loaded"], "inference engine")
    assert_same(result["saved"], result["from_inference"], "weights from an inference save")
    assert "saved by an engine without an optimizer" in result["refused"]
    assert "load_module_only=True" in result["refused"]
    optimizer_file = Path(result["optimizer_file"])
    metadata = json.loads((optimizer_file.parent / "checkpoint_meta.json").read_text())
    entries = [f for f in metadata["files"] if f["name"] == optimizer_file.name]
    assert optimizer_file.parent.parent == tmp_path and optimizer_file.is_file()
    assert [(f["role"], f["rank"]) for f in entries] == [("shard of rank 0", 0)]
