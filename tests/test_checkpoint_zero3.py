"""Checkpoints and ``save_16bit_model`` under ZeRO-3, on real gloo groups of 1, 2 and 3 processes.

The model is checkpoint_training's (odd sizes, a tied weight, a frozen layer, a buffer) with a
persistence threshold that keeps the biases whole and partitions every weight, so both kinds of
ZeRO-3 bucket (one partitioned parameter each; persistent parameters together) are saved.
Results are compared with checkpoint_training's single-process AdamW reference to 1e-6.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from checkpoint_training import (
    GAS,
    assert_same,
    config,
    global_batches,
    lr_at,
    make_model,
    max_relative_difference,
    param_groups,
    reference,
    reference_tolerance,
    tensors_in,
    train,
)
from conftest import REPO_ROOT

PERSIST = 19  # biases (<= 19 elements) stay whole; weights (>= 57) are partitioned
PARTITIONED = ("embed.weight", "mid.weight", "frozen.weight", "head.weight", "head2.weight")


def build(seed: int, world: int, stage: int, dtype: str = "fp32", gather_on_save=None):
    import deepspeed_cpp as deepspeed

    cfg = config(world, stage, dtype)
    if stage == 3:
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = PERSIST
    if gather_on_save is not None:
        cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = gather_on_save
    model = make_model(seed)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=cfg)
    return engine


def weights(engine) -> dict[str, torch.Tensor]:
    """The whole weights on every rank (gathered under ZeRO-3)."""
    return {n: t.detach().clone() for n, t in engine.full_module_state_dict().items()}


class GatherCounter:
    """Counts, on this rank, the partitioned parameters held whole each time a gather finishes:
    a save that gathers one parameter at a time never sees more than one."""

    def __init__(self, module):
        from deepspeed_cpp.runtime.zero import partitioned_params as pp

        self.pp, self.most, self.gathers = pp, 0, 0
        self.params = [p for p in module.parameters() if pp.is_partitioned(p)]
        self.original = pp.wait_gather

    def _wait(self, param):
        finishing = param.ds_status == self.pp.ZeroParamStatus.INFLIGHT  # else a no-op call
        self.original(param)
        if not finishing:
            return
        whole = sum(p.ds_status == self.pp.ZeroParamStatus.AVAILABLE for p in self.params)
        self.most, self.gathers = max(self.most, whole), self.gathers + 1

    def __enter__(self):
        self.pp.wait_gather = self._wait
        return self

    def __exit__(self, *exc_info):
        self.pp.wait_gather = self.original


# ---- resharding across world sizes and stages --------------------------------------------------


def train_and_save_job(directory: str, stage: int, model_seed: int, data_seed: int, steps: int):
    engine = build(model_seed, dist.get_world_size(), stage)
    train(engine, global_batches(data_seed, steps))
    with GatherCounter(engine.module) as counter:
        engine.save_checkpoint(directory, client_state={"world": dist.get_world_size()})
    return weights(engine), counter.most, counter.gathers


def load_and_train_job(directory: str, stage: int, data_seed: int, steps_done: int, steps: int):
    engine = build(12345, dist.get_world_size(), stage)  # other initial weights: the load wins
    path, client_state = engine.load_checkpoint(directory)
    loaded = {"path": path, "client_state": client_state, "global_steps": engine.global_steps,
              "lr": engine.get_lr(), "weights": weights(engine)}  # fmt: skip
    train(engine, global_batches(data_seed, steps_done + steps)[steps_done:])
    return loaded, weights(engine), engine.global_steps, engine.micro_steps


RESHARD_CASES = [
    # (saved world, saved stage, loading world, loading stage)
    (2, 3, 3, 3),
    (3, 3, 2, 3),
    (2, 3, 1, 3),
    (2, 2, 3, 3),  # across stages: per parameter, from stage-2 buckets to one per parameter
    (3, 3, 2, 2),
    (1, 1, 3, 3),
]


@pytest.mark.parametrize("saved_world, saved_stage, world, stage", RESHARD_CASES)
def test_reshard_continues_as_uninterrupted_run(
    pools, tmp_path, saved_world, saved_stage, world, stage
):
    model_seed, data_seed = (int(v) for v in torch.randint(0, 2**30, (2,)))
    before, after = 3, 2
    saves = pools(saved_world).run(
        train_and_save_job, str(tmp_path), saved_stage, model_seed, data_seed, before
    )
    saved = saves[0][0]
    if saved_stage == 3:
        for _, most, gathers in saves:
            # Each of the 4 partitioned parameters (5 names: head2.weight is head.weight, tied,
            # gathered once for both) was gathered, never two at once, on every rank.
            assert most == 1 and gathers == len(PARTITIONED) - 1
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
        assert_same(loaded["weights"], saved, "loaded weights")
        assert global_steps == before + after and micro_steps == (before + after) * GAS[world]
        assert_same(final, results[0][1], "ranks agree")
    assert max_relative_difference(results[0][1], expected) <= reference_tolerance(worlds)
    assert max_relative_difference(results[0][1], expected_saved) > 1e-3  # can fail


# ---- round trip: everything comes back, training goes on as if never stopped -----------------


def _snapshot(engine) -> dict:
    return {
        "weights": weights(engine),
        "shards": [
            {"master": s["master"].clone(),
             "state": {k: v.clone() if torch.is_tensor(v) else v for k, v in s["state"].items()}}
            for s in engine.optimizer.shard_state()
        ],
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in engine.optimizer.param_groups
        ],
        "scheduler": engine.lr_scheduler.state_dict(),
        "counters": (engine.global_steps, engine.global_samples, engine.micro_steps),
    }  # fmt: skip


def round_trip_job(directory: str, dtype: str, seed: int):
    from deepspeed_cpp.runtime.checkpoint.layout import optimizer_shard_file

    world = dist.get_world_size()
    original = build(seed, world, 3, dtype)
    train(original, global_batches(seed, 3))
    original.save_checkpoint(directory, tag="round_trip")
    saved = _snapshot(original)
    shard_file = torch.load(
        f"{directory}/round_trip/{optimizer_shard_file(dist.get_rank())}", weights_only=True
    )
    compact = all(t.untyped_storage().nbytes() == t.nbytes for t in tensors_in(shard_file))

    other = build(seed + 1, world, 3, dtype)
    train(other, global_batches(seed + 1, 1))  # some state of its own, to be overwritten
    other.load_checkpoint(directory, tag="round_trip")
    loaded = _snapshot(other)
    batches = global_batches(seed + 2, 2)
    train(original, batches)
    train(other, batches)
    return saved, loaded, compact, weights(original), weights(other)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip_restores_everything(pools, tmp_path, dtype):
    seed = int(torch.randint(0, 2**30, (1,)))
    results = pools(2).run(round_trip_job, str(tmp_path), dtype, seed)
    for rank, (saved, loaded, compact, uninterrupted, resumed) in enumerate(results):
        assert_same(saved, loaded, f"rank {rank}")
        assert saved["shards"][0]["state"], "the optimizer has state to restore"
        assert compact, "shard files hold each slice alone, not the storage it views"
        # The resumed engine continues bitwise as the one that never stopped.
        assert_same(uninterrupted, resumed, f"rank {rank} continued")
    if dtype == "fp32":
        # The same data as a 5-step run from the start; the reference is single-process AdamW.
        model_seed = seed
        steps = global_batches(seed, 3) + global_batches(seed + 2, 2)
        expected = _reference_on(model_seed, steps, [2] * 5)
        assert max_relative_difference(results[0][4], expected) <= 1e-6
    else:
        assert results[0][4]["mid.weight"].dtype == torch.bfloat16


def _reference_on(model_seed: int, batches, worlds):
    """checkpoint_training.reference over given batches (it draws its own from a data seed)."""
    import checkpoint_training

    original = checkpoint_training.global_batches
    checkpoint_training.global_batches = lambda seed, steps: batches[:steps]
    try:
        return reference(model_seed, 0, worlds)
    finally:
        checkpoint_training.global_batches = original


# ---- zero_to_fp32 of a ZeRO-3 checkpoint -------------------------------------------------------


def consolidate_save_job(directory: str, dtype: str, seed: int):
    engine = build(seed, dist.get_world_size(), 3, dtype)
    train(engine, global_batches(seed, 3))
    engine.save_checkpoint(directory)
    # Every trainable parameter's fp32 master, put together from every rank's shard states.
    layout = engine.optimizer.layout()
    owned = engine.optimizer.owned_ranges()
    masters = []
    for bucket, size in enumerate(layout.bucket_sizes):
        full = torch.zeros(size)
        start, count = owned[bucket]
        full[start : start + count] = engine.optimizer.shard_state()[bucket]["master"]
        dist.all_reduce(full)
        masters.append(full)
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return weights(engine), {
        names[id(p)]: masters[b][o : o + p.ds_numel].view(p.ds_shape)
        for p, b, o in zip(layout.params, layout.param_bucket, layout.param_offset)
    }


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero_to_fp32_consolidates_a_stage3_checkpoint(pools, tmp_path, dtype):
    from safetensors.torch import load_file

    from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    seed = int(torch.randint(0, 2**30, (1,)))
    checkpoint = tmp_path / "checkpoints"
    model_state, masters = pools(3).run(consolidate_save_job, str(checkpoint), dtype, seed)[0]
    consolidated = get_fp32_state_dict_from_zero_checkpoint(checkpoint)
    assert list(consolidated) == list(model_state)
    assert consolidated["head2.weight"] is consolidated["head.weight"]
    for name, master in masters.items():
        assert consolidated[name].dtype == torch.float32
        assert torch.equal(consolidated[name], master), name
        # The model trains with these masters (rounded to bf16 in bf16).
        assert torch.equal(consolidated[name].to(model_state[name].dtype), model_state[name])
    assert torch.equal(consolidated["frozen.weight"], model_state["frozen.weight"].float())
    assert torch.equal(consolidated["offset"], model_state["offset"])
    if dtype == "fp32":
        # The masters above are checked bitwise; against the one-process run the sum order of
        # the 3-rank reduction shows (DS_TEST_SEED=2628061286: 1.29e-6, the same on 839b0d1).
        expected = reference(seed, seed, [3] * 3)
        assert max_relative_difference(consolidated, expected) <= reference_tolerance([3] * 3)

    for args, read in (
        (["out.bin"], lambda p: torch.load(p, weights_only=True)),
        (["out.safetensors", "--safe_serialization"], load_file),
    ):
        output = tmp_path / args[0]
        done = subprocess.run(
            [sys.executable, "-m", "deepspeed_cpp.utils.zero_to_fp32", str(checkpoint),
             str(output), *args[1:]],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert_same(read(output), consolidated, args[0])


# ---- load_module_only ------------------------------------------------------------------------


def module_only_job(directory: str, seed: int):
    world = dist.get_world_size()
    source = build(seed, world, 3)
    train(source, global_batches(seed, 2))
    source.save_checkpoint(directory)
    engine = build(seed + 1, world, 3)
    engine.load_checkpoint(directory, load_module_only=True)
    steps, loaded = engine.global_steps, weights(engine)
    train(engine, global_batches(seed + 2, 1))

    # A ZeRO-3 engine without an optimizer (inference) loads the weights into its shards.
    import deepspeed_cpp as deepspeed

    zero = {"stage": 3, "stage3_param_persistence_threshold": PERSIST}
    inference, *_ = deepspeed.initialize(
        model=make_model(seed + 3),
        config={
            "gradient_clipping": 0.0,
            "train_micro_batch_size_per_gpu": 2,
            "zero_optimization": zero,
        },
    )
    inference.load_checkpoint(directory)
    return weights(source), steps, loaded, weights(engine), weights(inference)


def test_load_module_only(pools, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    results = pools(2).run(module_only_job, str(tmp_path), seed)
    saved, steps, loaded, trained, inference = results[0]
    assert steps == 0
    assert_same(saved, loaded, "weights")
    assert_same(saved, inference, "inference engine")
    for other in results[1:]:
        assert_same(other[3], trained, "ranks agree")
    # Training restarts from the loaded weights (the fp32 masters re-read from them) with a
    # fresh AdamW, first lr.
    expected = reference(0, seed + 2, [2], weights=loaded)
    assert max_relative_difference(trained, expected) <= 1e-6
    assert max_relative_difference(trained, loaded) > 1e-4  # it did train


# ---- save_16bit_model ------------------------------------------------------------------------


def save_16bit_job(directory: str, stage: int, dtype: str, seed: int, gather_on_save):
    engine = build(seed, dist.get_world_size(), stage, dtype, gather_on_save=gather_on_save)
    train(engine, global_batches(seed, 2))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("deepspeed_cpp").addHandler(handler)
    try:
        with GatherCounter(engine.module) as counter:
            outcomes = [
                engine.save_16bit_model(directory),
                engine.save_16bit_model(directory, "model.safetensors"),
                engine.save_16bit_model(directory, "trainable.bin", exclude_frozen_parameters=True),
            ]
    finally:
        logging.getLogger("deepspeed_cpp").removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    # What accelerate's get_state_dict calls under ZeRO-3 (DeepSpeed's names), collective.
    consolidated = (
        engine.zero_gather_16bit_weights_on_model_save(),
        engine._zero3_consolidated_16bit_state_dict(),
        engine._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters=True),
    )
    return (
        outcomes,
        weights(engine),
        counter.most,
        warnings,
        engine.module.state_dict(),
        consolidated,
    )


@pytest.mark.parametrize("stage, dtype", [(3, "bf16"), (3, "fp32"), (2, "fp16"), (0, "bf16")])
def test_save_16bit_model_writes_the_whole_model_from_rank0(pools, tmp_path, stage, dtype):
    from safetensors.torch import load_file

    seed = int(torch.randint(0, 2**30, (1,)))
    results = pools(2).run(save_16bit_job, str(tmp_path), stage, dtype, seed, True)
    gathered = results[0][1]
    for outcomes, _, most, warnings, _, _ in results:
        assert outcomes == [True, True, True] and not warnings
        assert most <= 1  # ZeRO-3: one parameter whole at a time on every rank
    flag, whole, without_frozen = results[0][5]
    assert flag is True and list(whole) == list(gathered)
    assert_same(whole, gathered, "_zero3_consolidated_16bit_state_dict")
    assert whole["head2.weight"] is whole["head.weight"], "tied names share one tensor"
    assert set(without_frozen) == set(gathered) - {"frozen.weight", "frozen.bias"}
    assert results[1][5] == (True, {}, {}), "only rank 0 holds the consolidated state"
    from_torch = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    from_safetensors = load_file(tmp_path / "model.safetensors")
    trainable = torch.load(tmp_path / "trainable.bin", weights_only=True)
    assert list(from_torch) == list(gathered)
    assert_same(from_torch, gathered, "torch file")
    assert_same(dict(from_safetensors), gathered, "safetensors file")
    assert from_torch["mid.weight"].dtype == {"fp32": torch.float32, "bf16": torch.bfloat16,
                                              "fp16": torch.float16}[dtype]  # fmt: skip
    # Tied: one tensor in the torch file; a copy per name in safetensors. Each tensor is
    # stored alone (not the flat bucket it viewed).
    assert from_torch["head2.weight"].data_ptr() == from_torch["head.weight"].data_ptr()
    for name, tensor in from_torch.items():
        if name != "head2.weight":
            assert tensor.untyped_storage().nbytes() == tensor.nbytes, name
    assert set(trainable) == set(gathered) - {"frozen.weight", "frozen.bias"}
    assert_same(trainable, {n: gathered[n] for n in trainable}, "exclude_frozen_parameters")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.safetensors",
        "pytorch_model.bin",
        "trainable.bin",
    ]  # fmt: skip  (no temporary files left)
    # engine.module.state_dict() is DeepSpeed's: partitioned parameters are empty under ZeRO-3.
    module_state = results[1][4]
    for name, value in module_state.items():
        partitioned = stage == 3 and name in PARTITIONED
        assert value.shape == ((0,) if partitioned else gathered[name].shape), name


def test_save_16bit_model_without_gathering_saves_nothing(pools, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    results = pools(2).run(save_16bit_job, str(tmp_path), 3, "bf16", seed, None)
    for rank, (outcomes, _, most, warnings, _, consolidated) in enumerate(results):
        assert outcomes == [False, False, False] and most == 0
        assert consolidated[0] is False  # accelerate then has transformers save a checkpoint
        if rank == 0:
            assert len(warnings) == 3
            assert "stage3_gather_16bit_weights_on_model_save is false" in warnings[0]
        else:
            assert warnings == []
    assert list(tmp_path.iterdir()) == []


def failing_save_job(directory: str, seed: int):
    from deepspeed_cpp.runtime.checkpoint import CheckpointSaveError, saver

    engine = build(seed, dist.get_world_size(), 3, "bf16", gather_on_save=True)
    train(engine, global_batches(seed, 1))
    assert engine.save_16bit_model(directory)
    engine.save_checkpoint(directory, tag="good")
    saved = weights(engine)
    train(engine, global_batches(seed + 1, 1))
    errors = []

    def fail_on_rank1(staging, rank):
        if rank == 1:
            raise OSError(28, "No space left on device (injected)")

    def failing_torch_save(obj, target, *args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    original_save = torch.save
    saver.before_rank_files = fail_on_rank1
    try:
        engine.save_checkpoint(directory, tag="bad")
        errors.append("no error")
    except CheckpointSaveError as error:
        errors.append(str(error))
    finally:
        saver.before_rank_files = None
    if dist.get_rank() == 0:
        torch.save = failing_torch_save
    try:
        engine.save_16bit_model(directory)
        errors.append("no error")
    except (CheckpointSaveError, OSError) as error:
        errors.append(f"{type(error).__name__}: {error}")
    finally:
        torch.save = original_save
    return errors, saved


def test_failed_saves_raise_on_every_rank_and_keep_the_previous_files(pools, tmp_path):
    """A rank that fails must not leave another one waiting in a ZeRO-3 gather."""
    seed = int(torch.randint(0, 2**30, (1,)))
    results = pools(2).run(failing_save_job, str(tmp_path), seed)
    for errors, _ in results:
        assert "failed on 1 rank(s): rank 1: OSError" in errors[0]
        assert "No space left" in errors[1] and "rank 0" in errors[1]
    assert (tmp_path / "latest").read_text() == "good"
    kept = torch.load(tmp_path / "pytorch_model.bin", weights_only=True)
    assert_same(kept, results[0][1], "the previous model file")
    # No temporary file left, and no save lock file (it exists only while a save runs).
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_gather_16bit_weights_key_is_read():
    from deepspeed_cpp.runtime.config import DeepSpeedConfig
    from deepspeed_cpp.runtime.config.key_policy import ignored_key_paths

    raw = {"gradient_clipping": 0.0, "train_batch_size": 2, "zero_optimization": {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": True}}  # fmt: skip
    zero = DeepSpeedConfig.load(raw, world_size=1).zero_optimization
    assert zero.gather_16bit_weights_on_model_save is True
    ignored = ignored_key_paths()
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" not in ignored
    assert "zero_optimization.gather_16bit_weights_on_model_save" not in ignored
