"""deepspeed_cpp.hf.Trainer on 2 CPU ranks (gloo) against transformers' own Trainer in one
process on the same data: ZeRO stages 0-3, optimizer/schedule origins, gradient accumulation,
accelerate's world size on a machine without a GPU, and tensor parallelism
(``tensor_parallel.autotp_size``: TP ranks read the same batches). Checkpoints and exact resume:
test_hf_trainer_checkpoints.py."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from conftest import REPO_ROOT  # noqa: E402
from hf_trainer_jobs import (  # noqa: E402
    MICRO,
    SEARCH_CHOICES,
    WORLD,
    accelerate_world_without_our_fix,
    auto_config,
    hyperparameter_search_trials,
    load_pretrained_partitioned,
    partitioned_from_config_statistics,
    run_trainer,
    tiny_gpt2,
    tiny_llama,
)
from safetensors.torch import load_file, save_file  # noqa: E402


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' own Trainer, one process, the 2 ranks' global batch in one micro-batch."""
    spec = {"output_dir": str(tmp_path_factory.mktemp("reference")), "micro": MICRO * WORLD}
    return run_trainer(dict(spec, deepspeed=None))


def _assert_same_training(ours: dict, reference: dict, tolerance: float) -> None:
    assert len(ours["losses"]) == len(reference["losses"]) > 0
    for step, (a, b) in enumerate(zip(ours["losses"], reference["losses"])):
        assert abs(a - b) <= tolerance, f"step {step + 1}: loss {a} vs reference {b}"
    assert ours["learning_rates"] == pytest.approx(reference["learning_rates"], rel=1e-12)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(ours["weights"][name], value, atol=tolerance, rtol=0)


@pytest.mark.parametrize(
    "stage, offload", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)]
)
def test_zero_stage_losses_equal_one_process_reference(pool2, tmp_path, reference, stage, offload):
    config = auto_config(stage)
    if offload:
        # The Trainer's AdamW, swapped for DeepSpeedCPUAdam over the same param groups (as
        # accelerate does: zero_force_ds_cpu_optimizer), stepped on the offloaded fp32 masters.
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    results = pool2.run(
        run_trainer, {"output_dir": str(tmp_path), "micro": MICRO, "deepspeed": config}
    )
    ours = results[0]
    assert [r["world_size"] for r in results] == [WORLD, WORLD]
    assert ours["zero_stage"] == stage
    expected = "DeepSpeedCPUAdam" if offload else "AdamW"
    assert ours["engine_optimizer"] == expected, "HF's optimizer (no 'optimizer' in the config)"
    assert results[1]["losses"] == ours["losses"], "every rank logs the same global loss"
    _assert_same_training(ours, reference, tolerance=1e-5)


def test_tiny_llama_at_zero3_matches_the_one_process_reference(pool2, tmp_path):
    # Rotary positions, RMSNorm, a gated MLP, grouped-query attention and an untied output layer:
    # module shapes GPT-2 does not have, partitioned and gathered by the ZeRO-3 hooks.
    spec = {"model": "llama", "max_steps": 4, "micro": MICRO}
    ours = pool2.run(
        run_trainer, dict(spec, output_dir=str(tmp_path / "ours"), deepspeed=auto_config(3))
    )[0]
    theirs = run_trainer(
        dict(spec, output_dir=str(tmp_path / "theirs"), deepspeed=None, micro=MICRO * WORLD)
    )
    assert ours["zero_stage"] == 3
    assert "lm_head.weight" in ours["weights"] and "model.embed_tokens.weight" in ours["weights"]
    _assert_same_training(ours, theirs, tolerance=1e-5)


def test_two_scalar_regression_model_at_zero2_and_zero3(pool2, tmp_path):
    # Two 0-dimensional parameters, partitioned at ZeRO-3 (threshold 0: one element over two
    # ranks, one of them holding only padding). A plain torch module: no model config to fill
    # the bucket sizes from, so they are given.
    spec = {"model": "regression", "max_steps": 5, "micro": MICRO, "learning_rate": 0.1}
    theirs = run_trainer(
        dict(spec, output_dir=str(tmp_path / "theirs"), deepspeed=None, micro=MICRO * WORLD)
    )
    assert theirs["losses"][-1] < theirs["losses"][0], "the reference learns"
    for stage in (2, 3):
        config = auto_config(stage)
        config["zero_optimization"].update(
            reduce_bucket_size=1000,
            stage3_prefetch_bucket_size=1000,
            stage3_param_persistence_threshold=0,
        )
        output_dir = str(tmp_path / f"zero{stage}")
        ours = pool2.run(run_trainer, dict(spec, output_dir=output_dir, deepspeed=config))[0]
        assert ours["zero_stage"] == stage
        assert set(ours["weights"]) == {"a", "b"} and ours["weights"]["a"].dim() == 0
        _assert_same_training(ours, theirs, tolerance=1e-6)


def test_model_built_partitioned_under_hf_deepspeed_config_trains_like_the_reference(
    pool2, tmp_path, reference
):
    config = auto_config(3)
    # Small enough that the embeddings (64 x 32) are partitioned, not kept whole on every rank.
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    spec = {"output_dir": str(tmp_path), "micro": MICRO, "deepspeed": config}
    ours = pool2.run(run_trainer, dict(spec, zero_init=True))[0]
    _assert_same_training(ours, reference, tolerance=1e-5)


def test_from_pretrained_zero3_loads_saved_weights_into_partitions(pool2, tmp_path):
    # Saved weights that no initialisation would draw: every tensor comes from the file.
    llama = tiny_llama()
    with torch.no_grad():
        for param in llama.parameters():
            param.normal_()
    folder = tmp_path / "llama"
    llama.save_pretrained(folder)
    # Broken copies: one tensor left out, one tensor of the wrong shape.
    saved = load_file(str(folder / "model.safetensors"))
    for case, change in {
        "missing": lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
        "shape": lambda t: t.update({"model.norm.weight": torch.ones(31)}),
    }.items():
        shutil.copytree(folder, f"{folder}-{case}")
        broken = dict(saved)
        change(broken)
        save_file(broken, f"{folder}-{case}/model.safetensors", metadata={"format": "pt"})
    first, second = pool2.run(load_pretrained_partitioned, str(folder))
    assert first["partitioned"]["model.embed_tokens.weight"], "64 x 32 > the threshold of 100"
    assert not first["partitioned"]["model.norm.weight"], "32 elements stay whole"
    assert not first["tied"] and not first["training"]
    expected = llama.state_dict()
    assert set(first["state"]) == set(expected)
    for name, value in expected.items():
        assert torch.equal(first["state"][name], value), name
        assert torch.equal(second["state"][name], value), f"rank 1: {name}"
    for errors in (first["errors"], second["errors"]):
        assert "has no weights for ['model.layers.1.mlp.up_proj.weight']" in errors["missing"]
        assert "'model.norm.weight' has shape [31] in the file" in errors["shape"]
        assert "expects [32]" in errors["shape"]
        assert (
            "needs a live HfDeepSpeedConfig with zero_optimization.stage = 3"
            in (errors["no_config"])
        )


def test_tied_gpt2_from_pretrained_zero3_trains_like_the_reference(pool2, tmp_path, reference):
    # The reference's initial weights, saved the way transformers saves them (the tied output
    # layer stored once; in shards, found through the index), loaded into partitions and trained
    # by our Trainer at ZeRO-3.
    tiny_gpt2().save_pretrained(tmp_path / "saved", max_shard_size="40KB")
    assert len(list((tmp_path / "saved").glob("model-*.safetensors"))) > 1
    assert (tmp_path / "saved" / "model.safetensors.index.json").is_file()
    config = auto_config(3)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 100
    spec = {"output_dir": str(tmp_path / "out"), "micro": MICRO, "deepspeed": config}
    ours = pool2.run(run_trainer, dict(spec, pretrained=str(tmp_path / "saved")))[0]
    _assert_same_training(ours, reference, tolerance=1e-5)


def test_from_config_under_zero_init_gets_the_models_own_initialisation(pool2):
    # Without initialize_weights_zero3 the embeddings would keep torch's N(0, 1) default: the
    # model's init ran on empty shards.
    first, second = pool2.run(partitioned_from_config_statistics)
    assert first["partitioned"]
    spread = first["initializer_range"]
    assert first["embedding_std"] == pytest.approx(spread, rel=0.15)
    # GPT-2 scales residual projections by 1/sqrt(2 x layers).
    assert first["projection_std"] == pytest.approx(spread / (2 * first["layers"]) ** 0.5, rel=0.2)
    assert torch.equal(first["layer_norm_weight"], torch.ones(32))
    assert torch.equal(first["attention_bias"], torch.zeros(96))
    for name, value in first["state"].items():
        assert torch.equal(second["state"][name], value), f"{name} differs between ranks"


def test_seq2seq_trainer_at_zero2_matches_the_reference(pool2, tmp_path):
    # T5's forward takes **kwargs but its loss ignores num_items_in_batch (a mean), while the
    # Trainer's compute_loss multiplies by the world size for token averaging: the loss would be
    # doubled on 2 ranks. Averaging per rank instead equals the one-process mean (equal lengths).
    spec = {
        "model": "t5",
        "max_steps": 4,
        "micro": MICRO,
        "optim_args": {"average_tokens_across_devices": False},
    }
    ours = pool2.run(
        run_trainer, dict(spec, output_dir=str(tmp_path / "ours"), deepspeed=auto_config(2))
    )[0]
    theirs = run_trainer(
        dict(spec, output_dir=str(tmp_path / "theirs"), deepspeed=None, micro=MICRO * WORLD)
    )
    assert ours["zero_stage"] == 2
    _assert_same_training(ours, theirs, tolerance=1e-5)


def test_optimizer_and_schedule_passed_to_the_trainer(pool2, tmp_path):
    spec = {"own_optimizer": True, "max_steps": 4, "micro": MICRO}
    ours = pool2.run(
        run_trainer, dict(spec, output_dir=str(tmp_path / "ours"), deepspeed=auto_config(1))
    )[0]
    theirs = run_trainer(
        dict(spec, output_dir=str(tmp_path / "theirs"), deepspeed=None, micro=MICRO * WORLD)
    )
    assert ours["engine_optimizer"] == "SGD" and ours["engine_scheduler"] == "StepLR"
    assert theirs["learning_rates"] == [0.05, 0.05, 0.025, 0.025]
    _assert_same_training(ours, theirs, tolerance=1e-5)


def test_a_schedule_given_both_ways_is_refused(pool2, tmp_path):
    spec = {
        "own_optimizer": True,
        "output_dir": str(tmp_path),
        "deepspeed": auto_config(1, scheduler=SCHEDULER),
    }
    with pytest.raises(RuntimeError, match="'scheduler' section too: expected one of them"):
        pool2.run(run_trainer, spec)


def test_gradient_accumulation_matches_one_big_batch(pool2, tmp_path, reference):
    # 8 samples an optimizer step either way: the reference's one micro-batch of 8 in one
    # process, and here micro-batches of 1 sample, 4 accumulated on each of the 2 ranks.
    spec = {"output_dir": str(tmp_path), "micro": 1, "accumulation": 4}
    accumulated = pool2.run(run_trainer, dict(spec, deepspeed=auto_config(2)))[0]
    _assert_same_training(accumulated, reference, tolerance=1e-5)


OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto"}}
SCHEDULER = {
    "type": "WarmupDecayLR",
    "params": {
        "warmup_min_lr": "auto",
        "warmup_max_lr": "auto",
        "warmup_num_steps": "auto",
        "total_num_steps": "auto",
        "warmup_type": "linear",
    },
}


def test_optimizer_and_schedule_from_either_side(pool2, tmp_path):
    runs = {}
    for optimizer_from in ("config", "trainer"):
        for schedule_from in ("config", "trainer"):
            sections = {}
            if optimizer_from == "config":
                sections["optimizer"] = OPTIMIZER
            if schedule_from == "config":
                sections["scheduler"] = SCHEDULER
            spec = {
                "output_dir": str(tmp_path / f"{optimizer_from}-{schedule_from}"),
                "micro": MICRO,
                "deepspeed": auto_config(2, **sections),
                "max_steps": 4,
                "optim_args": {"weight_decay": 0.0},
            }
            runs[optimizer_from, schedule_from] = pool2.run(run_trainer, spec)[0]
    for (optimizer_from, schedule_from), run in runs.items():
        expected_optimizer = "FusedAdam" if optimizer_from == "config" else "AdamW"
        expected_schedule = "WarmupDecayLR" if schedule_from == "config" else "LambdaLR"
        assert run["engine_optimizer"] == expected_optimizer, (optimizer_from, schedule_from)
        assert run["engine_scheduler"] == expected_schedule, (optimizer_from, schedule_from)
    # The schedule decides the learning rates, whoever built the optimizer.
    for schedule_from in ("config", "trainer"):
        assert (
            runs["config", schedule_from]["learning_rates"]
            == runs["trainer", schedule_from]["learning_rates"]
        )
    # The Trainer's linear schedule over 4 steps, and the config's warm-up (1 step) then decay.
    assert runs["trainer", "trainer"]["learning_rates"] == pytest.approx(
        [1e-3, 7.5e-4, 5e-4, 2.5e-4], rel=1e-12
    )
    assert runs["config", "config"]["learning_rates"][0] == 0.0  # warm-up from warmup_min_lr
    # Our CPU AdamW follows torch's AdamW closely: the same losses as torch's AdamW.
    assert runs["config", "trainer"]["losses"] == pytest.approx(
        runs["trainer", "trainer"]["losses"], abs=1e-5
    )


def test_config_schedule_logs_the_rates_transformers_logs_with_deepspeed(pool2, tmp_path):
    """The guide's template schedule (WarmupDecayLR, "auto" params, log warm-up): with DeepSpeed
    the engine steps it inside ``backward``, so transformers' Trainer logs at step N the rate the
    schedule holds after N steps, DeepSpeed's ``f(N - 1)``. Our Trainer logged the rate the step
    had used, ``f(N - 2)``: 0.0 at step 2 where transformers logs the warmed-up rate (the losses
    were equal). The reference is transformers' own Trainer driving the engine through
    accelerate's DeepSpeed path (the unmodified example under the alias, 2 ranks), and
    DeepSpeed's formula for the numbers."""
    from launch_helpers import free_port, launch_env

    # The template's scheduler: SCHEDULER without its warmup_type (DeepSpeed's default, "log").
    params = {k: v for k, v in SCHEDULER["params"].items() if k != "warmup_type"}
    config = auto_config(
        2, optimizer=OPTIMIZER, scheduler={"type": "WarmupDecayLR", "params": params}
    )
    lr, warmup, steps = 0.01, 3, 6
    example = REPO_ROOT / "examples" / "hf_trainer" / "train_tiny_gpt2.py"
    script = tmp_path / "train_hf.py"
    script.write_text(
        example.read_text().replace(
            "from deepspeed_cpp.hf import Trainer, TrainingArguments",
            "from transformers import Trainer, TrainingArguments",
        )
    )
    (tmp_path / "ds_config.json").write_text(json.dumps(config))
    command = [
        sys.executable, "-m", "deepspeed_cpp.launcher", "--num_gpus", str(WORLD),
        "--master_port", str(free_port()), "--alias-deepspeed", str(script),
        "--deepspeed", str(tmp_path / "ds_config.json"),
        "--output_dir", str(tmp_path / "alias"),
        "--per_device_train_batch_size", str(MICRO), "--max_steps", str(steps),
        "--learning_rate", str(lr), "--warmup_steps", str(warmup), "--logging_steps", "1",
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true",
        "--dataloader_pin_memory", "false",
    ]  # fmt: skip
    alias = subprocess.Popen(
        command,
        env=launch_env(PYTHONPATH=str(REPO_ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    try:
        spec = {
            "output_dir": str(tmp_path / "ours"),
            "micro": MICRO,
            "deepspeed": config,
            "max_steps": steps,
            "learning_rate": lr,
            "optim_args": {"warmup_steps": warmup},
        }
        ours = pool2.run(run_trainer, spec)[0]
        output, _ = alias.communicate(timeout=400)
    finally:
        if alias.poll() is None:
            alias.kill()
            alias.communicate()
    assert alias.returncode == 0, output[-8000:]
    assert ours["engine_scheduler"] == "WarmupDecayLR"
    # DeepSpeed's WarmupDecayLR after i + 1 steps (last_batch_iteration i): log warm-up over
    # `warmup` steps, then linear decay to 0 at `steps`.
    deepspeed_rates = [
        lr * math.log(i + 1) / math.log(warmup) if i < warmup
        else lr * (steps - i) / (steps - warmup)
        for i in range(steps)
    ]  # fmt: skip
    assert ours["learning_rates"] == pytest.approx(deepspeed_rates, rel=1e-12, abs=1e-15)
    theirs = json.loads((tmp_path / "alias" / "summary.json").read_text())
    assert ours["learning_rates"] == pytest.approx(theirs["learning_rates"], rel=1e-12, abs=1e-15)
    assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-5, rel=0)


def test_config_mismatch_names_every_key_on_every_rank(pool2, tmp_path):
    config = dict(auto_config(2), train_micro_batch_size_per_gpu=8, gradient_clipping=0.3)
    with pytest.raises(RuntimeError) as caught:
        pool2.run(run_trainer, {"output_dir": str(tmp_path), "deepspeed": config})
    message = str(caught.value)
    for rank in (0, 1):
        assert f"rank {rank}:" in message
    assert (
        "'train_micro_batch_size_per_gpu' = 8" in message and "'gradient_clipping' = 0.3" in message
    )
    for section in message.split("rank ")[1:]:
        assert "ConfigMismatchError" in section


def test_fp16_overflow_skips_the_step_and_the_schedule(pool2, tmp_path):
    # A loss scale of 2**32 overflows fp16 gradients: each step is skipped (the scale halves),
    # the schedule does not move, and the Trainer can still read the learning rate.
    config = auto_config(2, fp16={"enabled": "auto", "initial_scale_power": 32})
    spec = {
        "output_dir": str(tmp_path),
        "deepspeed": config,
        "max_steps": 2,
        "optim_args": {"fp16": True},
    }
    ours = pool2.run(run_trainer, spec)[0]
    assert ours["skipped_steps"] == 2 and ours["step_was_skipped"]
    assert ours["learning_rates"] == [1e-3, 1e-3]
    assert ours["last_lr"] and all(lr == 1e-3 for lr in ours["last_lr"])
    initial = tiny_gpt2().half().state_dict()
    for name, value in ours["weights"].items():
        assert torch.equal(value, initial[name]), f"{name} changed by a skipped step"


def test_accelerate_alone_sees_a_world_of_one_and_ours_sees_two(pool2):
    # The pitfall, reproduced: transformers' own arguments on 2 CPU ranks. Ours see the world of
    # two in every run above (test_zero_stage_losses_equal_one_process_reference checks it).
    assert pool2.run(accelerate_world_without_our_fix) == [1, 1]


def _assert_same_calls(ours: dict, theirs: dict, tolerance: float) -> None:
    """Each train() call's logged losses and learning rates, then the final weights."""
    assert len(ours["calls"]) == len(theirs["calls"]) > 1
    for call, (mine, reference) in enumerate(zip(ours["calls"], theirs["calls"]), start=1):
        assert [e["step"] for e in mine] == [e["step"] for e in reference], f"call {call}"
        for a, b in zip(mine, reference):
            assert abs(a["loss"] - b["loss"]) <= tolerance, f"call {call}: {a} vs {b}"
            assert a["learning_rate"] == pytest.approx(b["learning_rate"], rel=1e-12)
    for name, value in theirs["weights"].items():
        torch.testing.assert_close(ours["weights"][name], value, atol=tolerance, rtol=0)


def test_a_second_train_call_trains_on_with_a_fresh_engine(pool2, tmp_path):
    # transformers initialises DeepSpeed afresh on every train(): the second call trains the
    # model's current weights with a new optimizer and schedule. The reference is what a user
    # gets from transformers' own Trainer that way: a new Trainer holding the trained model.
    spec = {"max_steps": 3, "micro": MICRO, "trains": 2}
    theirs = run_trainer(
        dict(
            spec,
            output_dir=str(tmp_path / "theirs"),
            deepspeed=None,
            micro=MICRO * WORLD,
            new_trainer_each_train=True,
        )
    )
    first_losses = [entry["loss"] for entry in theirs["calls"][0]]
    assert theirs["calls"][1][0]["loss"] < first_losses[0], "the second call starts trained"
    for stage in (2, 3):
        output_dir = str(tmp_path / f"zero{stage}")
        ours = pool2.run(
            run_trainer, dict(spec, output_dir=output_dir, deepspeed=auto_config(stage))
        )
        assert ours[0]["zero_stage"] == stage
        assert ours[1]["calls"] == ours[0]["calls"], "every rank logs the same"
        _assert_same_calls(ours[0], theirs, tolerance=1e-5)


def test_a_second_train_call_with_the_callers_optimizer_is_refused(pool2, tmp_path):
    spec = {"own_optimizer": True, "max_steps": 1, "trains": 2, "output_dir": str(tmp_path)}
    with pytest.raises(
        RuntimeError, match=r"train\(\) again after an engine trained with the optim"
    ):
        pool2.run(run_trainer, dict(spec, deepspeed=auto_config(1)))


def test_auto_find_batch_size_rebuilds_the_engine_for_the_batch_that_fits(pool2, tmp_path):
    # The model runs "out of memory" above 4 samples a rank: accelerate's finder lowers the
    # batch from 8 (to 0.9 of it from accelerate 1.9 on, by half before) until it fits; each try
    # builds an engine for its batch (at ZeRO-3 the failed forward has gathered parameters). The
    # reference trains at the batch that fits from the start.
    spec = {"max_steps": 5, "learning_rate": 0.1}
    theirs = run_trainer(
        dict(spec, model="regression", output_dir=str(tmp_path / "theirs"), deepspeed=None, micro=8)
    )
    for stage in (2, 3):
        config = auto_config(stage)
        config["zero_optimization"].update(
            reduce_bucket_size=1000,
            stage3_prefetch_bucket_size=1000,
            stage3_param_persistence_threshold=0,
        )
        ours = pool2.run(
            run_trainer,
            dict(
                spec,
                model="regression_oom",
                output_dir=str(tmp_path / f"zero{stage}"),
                micro=8,
                deepspeed=config,
                optim_args={"auto_find_batch_size": True},
            ),
        )
        for rank, result in enumerate(ours):
            tried = result["batch_sizes_tried"]
            assert tried[0] == 8 and tried[-1] == 4, (stage, rank, tried)
            assert all(size > 4 for size in tried[:-1]), (stage, rank, tried)
            assert result["train_batch_size"] == result["engine_micro_batch"] == 4, (stage, rank)
        assert ours[0]["zero_stage"] == stage
        assert [entry["step"] for entry in ours[0]["log_history"]] == [1, 2, 3, 4, 5]
        _assert_same_training(ours[0], theirs, tolerance=1e-6)


def test_hyperparameter_search_builds_each_trials_engine_from_its_values(pool2, tmp_path):
    # optuna on rank 0, the trial's values broadcast to rank 1 (transformers' DDP search). The
    # config's optimizer takes its lr from the trial ("auto"), and the batch sizes too.
    optimizer = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}}
    config = auto_config(2, optimizer=optimizer)
    ours = pool2.run(
        hyperparameter_search_trials, {"output_dir": str(tmp_path / "ours"), "deepspeed": config}
    )
    theirs = hyperparameter_search_trials(
        {"output_dir": str(tmp_path / "theirs"), "deepspeed": None, "batch_scale": WORLD}
    )
    trials = ours[0]["trials"]
    assert ours[1]["trials"] == trials, "rank 1 trains rank 0's trials"
    assert len(trials) == len(theirs["trials"]) == 2
    assert {(t["learning_rate"], t["per_device_train_batch_size"]) for t in trials} == set(
        SEARCH_CHOICES.values()
    )
    for mine, reference in zip(trials, theirs["trials"]):
        assert mine["engine_optimizer"] == "FusedAdam"
        assert mine["engine_config_lr"] == mine["learning_rate"] == reference["learning_rate"]
        assert mine["engine_micro_batch"] == mine["per_device_train_batch_size"]
        assert (
            mine["per_device_train_batch_size"] * WORLD == reference["per_device_train_batch_size"]
        )
        assert mine["learning_rates"] == pytest.approx(reference["learning_rates"], rel=1e-12)
        assert mine["losses"] == pytest.approx(reference["losses"], abs=1e-5)
        assert mine["eval_loss"] == pytest.approx(reference["eval_loss"], abs=1e-5)
    assert ours[0]["best_objective"] == pytest.approx(theirs["best_objective"], abs=1e-5)
    assert ours[0]["best_params"] == theirs["best_params"]


def test_hf_trainer_at_tp2_matches_transformers_one_process_trainer(pool2, tmp_path):
    # DP is 1: both ranks read the same batches (accelerate's loaders sharded by the TP mesh),
    # the one-process reference reads them too. Adam's eps keeps float32 rounding of near-zero
    # gradients from deciding update signs.
    spec = {"micro": 4, "max_steps": 4, "optim_args": {"adam_epsilon": 1e-4}}
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
    }
    ours = pool2.run(
        run_trainer,
        dict(spec, output_dir=str(tmp_path / "ours"), deepspeed=config, save_model=True),
        timeout=600.0,
    )
    theirs = run_trainer(dict(spec, output_dir=str(tmp_path / "theirs"), deepspeed=None))
    assert ours[0]["train_batch_size"] == 4  # each rank's batch: the same on both
    assert ours[1]["losses"] == ours[0]["losses"]
    assert ours[0]["losses"] == pytest.approx(theirs["losses"], rel=1e-6, abs=0)
    assert ours[0]["grad_norms"] == pytest.approx(theirs["grad_norms"], rel=1e-5, abs=0)
    for name, value in theirs["weights"].items():
        torch.testing.assert_close(ours[0]["weights"][name], value, atol=1e-5, rtol=0)
    saved = load_file(str(tmp_path / "ours" / "model.safetensors"))  # save_model: unsplit
    for name, value in saved.items():
        torch.testing.assert_close(value, ours[0]["weights"][name], atol=0, rtol=0)
    assert saved["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)
