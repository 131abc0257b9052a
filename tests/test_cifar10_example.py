"""examples/cifar10: its generated data, its configs, short real runs on 2 processes, and the
DeepSpeedExamples CIFAR-10 API sequence at ZeRO stages 0-2 in fp32 and bf16."""

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO_ROOT
from launch_helpers import finish, free_port, launch_env

from deepspeed_cpp.plot import read_run

EXAMPLE_DIR = REPO_ROOT / "examples" / "cifar10"
sys.path.insert(0, str(EXAMPLE_DIR))

from cifar10_data import (  # noqa: E402 - the example's folder is put on the path above
    GENERATED_SEED,
    generated_cifar10,
    load_cifar10,
    real_cifar10_present,
)

PYTHON = sys.executable
RUN_TIMEOUT = 300
STEPS = 60  # of the ZeRO-2 and ZeRO-3 runs in test_example_zero2_two_processes_learns


def launcher_command(script, script_args, num_procs=2) -> list[str]:
    """``python -m deepspeed_cpp.launcher --num_procs N script args`` on a free port."""
    return [PYTHON, "-m", "deepspeed_cpp.launcher", "--num_procs", str(num_procs),
            "--master_port", str(free_port()), str(script), *script_args]  # fmt: skip


def launch(script, script_args, num_procs=2, cwd=None):
    return subprocess.run(
        launcher_command(script, script_args, num_procs),
        env=launch_env(), cwd=cwd, capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip


# ---- the generated data set ----------------------------------------------------------------


def test_generated_data_is_cifar_shaped_balanced_and_reproducible():
    train, test = generated_cifar10(train_size=3000, test_size=500)
    images, labels = train.tensors
    assert images.shape == (3000, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.int64 and test.tensors[0].shape == (500, 3, 32, 32)
    counts = torch.bincount(labels, minlength=10)
    assert counts.min() >= 0.7 * 300 and counts.max() <= 1.3 * 300, counts
    again, _ = generated_cifar10(train_size=3000, test_size=500)
    assert torch.equal(again.tensors[0], images) and torch.equal(again.tensors[1], labels)
    other, _ = generated_cifar10(train_size=3000, test_size=500, seed=GENERATED_SEED + 1)
    assert not torch.equal(other.tensors[0], images)
    assert not torch.equal(test.tensors[0][:100], images[:100])


def test_generated_data_is_learnable_from_spatial_structure_not_colour_alone():
    train, test = generated_cifar10(train_size=4000, test_size=1000)
    (images, labels), (test_images, test_labels) = train.tensors, test.tensors
    # Colour alone is shared by class pairs (c, c+5): a nearest-mean-colour rule cannot tell
    # the pair apart, so it stays well below what a model that sees the stripes reaches.
    colour = images.mean(dim=(2, 3)).double()
    means = torch.stack([colour[labels == c].mean(0) for c in range(10)])
    colour_guess = torch.cdist(test_images.mean(dim=(2, 3)).double(), means).argmin(1)
    colour_accuracy = (colour_guess == test_labels).double().mean().item()
    assert colour_accuracy < 0.6, colour_accuracy

    # The label is in the stripes: a linear read-out of the phase-free amplitude spectrum,
    # solved in closed form (ridge regression, float64), recovers it almost always. A learner
    # that finds orientation and frequency can therefore go far beyond chance (0.1).
    def spectrum_features(x):
        amplitude = torch.fft.rfft2(x.mean(1)).abs().flatten(1) / 32
        return torch.cat([amplitude, torch.ones(len(x), 1)], 1).double()

    features, targets = spectrum_features(images), F.one_hot(labels, 10).double()
    gram = features.T @ features + torch.eye(features.shape[1], dtype=torch.float64)
    weights = torch.linalg.solve(gram, features.T @ targets)
    predicted = (spectrum_features(test_images) @ weights).argmax(1)
    spectrum_accuracy = (predicted == test_labels).double().mean().item()
    assert spectrum_accuracy > 0.9, spectrum_accuracy


def test_missing_real_data_falls_back_to_generated_and_says_so(tmp_path):
    assert not real_cifar10_present(tmp_path)
    train, test, description = load_cifar10(tmp_path)
    assert f"not found in {str(tmp_path)!r}" in description and "GENERATED" in description
    assert len(train) == 10000 and len(test) == 2000
    assert "no --data-dir given" in load_cifar10(None)[2]
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "batches.meta").write_bytes(b"")
    assert real_cifar10_present(tmp_path)


CONFIG_CHECK = """
import json, sys

import torch

import deepspeed_cpp as deepspeed
from cifar10_deepspeed import Net

for path in sys.argv[1:]:
    torch.manual_seed(0)
    net = Net()
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=net.parameters(), config=path
    )
    losses = []
    for _ in range(2):
        images = torch.randn(32, 3, 32, 32)
        if engine.bfloat16_enabled():
            images = images.to(torch.bfloat16)
        labels = torch.randint(0, 10, (32,))
        loss = torch.nn.functional.cross_entropy(engine(images).float(), labels)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    print(json.dumps({"path": path, "stage": engine.zero_optimization_stage(),
                      "bf16": engine.bfloat16_enabled(), "losses": losses}))
"""


def test_every_config_is_accepted_by_the_engine():
    # One plain process (a world of one) builds an engine from each file and takes two steps:
    # the engine rejects unknown keys, so this proves every key of every file is understood.
    paths = [
        f"ds_config_zero{stage}_{dtype}.json"
        for stage in (0, 1, 2, 3)
        for dtype in ("fp32", "bf16")
    ]
    for path in paths:
        config = json.loads((EXAMPLE_DIR / path).read_text())
        assert "fp16" not in config or not config["fp16"]["enabled"]
    run = subprocess.run(
        [PYTHON, "-c", CONFIG_CHECK, *paths], cwd=EXAMPLE_DIR, env=launch_env(),
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["path"] for r in results] == paths
    for result in results:
        assert result["stage"] == int(result["path"][len("ds_config_zero")])
        assert result["bf16"] is result["path"].endswith("_bf16.json")
        assert all(math.isfinite(loss) for loss in result["losses"])


# ---- the example, run for real -------------------------------------------------------------


def start_example(tmp_path, config, steps, log_interval, extra=()) -> subprocess.Popen:
    """The example under the launcher on 2 processes, started from the example's own folder with
    relative paths, as its README shows too; ``finish_example`` checks what it wrote."""
    return subprocess.Popen(
        launcher_command("cifar10_deepspeed.py", [
            "--deepspeed", "--deepspeed_config", config, "--epochs", "50",
            "--max-steps", str(steps), "--log-interval", str(log_interval),
            "--data-dir", str(tmp_path / "no_data_here"), "--output-dir", str(tmp_path / "out"),
            *extra]),
        env=launch_env(), cwd=EXAMPLE_DIR, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


def finish_example(started: subprocess.Popen, tmp_path, steps):
    done = finish(started, RUN_TIMEOUT)
    stdout = done.stdout
    assert done.returncode == 0, stdout[-3000:] + done.stderr[-3000:]
    assert "using a GENERATED CIFAR-shaped data set" in stdout
    output_dir = tmp_path / "out"
    metrics = json.loads((output_dir / "metrics.json").read_text())
    # The curves went through the engine's csv_monitor, and deepspeed_cpp.plot drew the PNG.
    curves = read_run(output_dir / "csv_monitor")
    assert set(curves) == {
        "Train/Samples/train_loss", "Train/Samples/lr", "Train/Eval/test_accuracy"
    }  # fmt: skip
    batch = 2 * 32  # the global batch: 2 processes of 32 images
    assert [samples for samples, _ in curves["Train/Samples/lr"]] == [
        batch * (i + 1) for i in range(steps)
    ]
    assert curves["Train/Eval/test_accuracy"] == [
        (batch * steps, pytest.approx(metrics["final_test_accuracy"]))
    ]
    assert f"wrote {output_dir / 'loss_curve.png'} (from {output_dir / 'csv_monitor'})" in stdout
    assert (output_dir / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return stdout, metrics


def test_example_zero2_two_processes_learns(tmp_path):
    # 60 steps take ZeRO-2's loss from 2.29 to 1.16 and its test accuracy to 0.43 (chance: 0.1).
    # ZeRO-3 (two of the four weights partitioned, the small ones persistent) trains the same
    # network on the same data: the same curve up to float32 reduction order. Both runs at once:
    # most of a run is processes importing torch and building the data set, one core each.
    with_tensorboard = importlib.util.find_spec("tensorboard") is not None
    zero2_run = start_example(tmp_path, "ds_config_zero2_fp32.json", STEPS, 10)
    zero3_run = start_example(
        tmp_path / "zero3", "ds_config_zero3_fp32.json", STEPS, 10,
        extra=["--tensorboard"] if with_tensorboard else [],
    )  # fmt: skip
    stdout, metrics = finish_example(zero2_run, tmp_path, STEPS)
    _, zero3 = finish_example(zero3_run, tmp_path / "zero3", STEPS)
    assert metrics["world_size"] == 2 and metrics["steps"] == STEPS
    losses = [loss for _, loss in metrics["loss_curve"]]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.85 * losses[0], losses
    assert metrics["final_test_accuracy"] > 0.3, metrics["final_test_accuracy"]  # chance: 0.1
    assert "Accuracy of the network on the 2000 test images" in stdout
    if with_tensorboard:  # the same curves as TensorBoard event files beside the CSV ones
        tensorboard = read_run(tmp_path / "zero3" / "out" / "tensorboard")
        csv_curves = read_run(tmp_path / "zero3" / "out" / "csv_monitor")
        assert set(tensorboard) == set(csv_curves)
        for event, points in csv_curves.items():
            assert [x for x, _ in tensorboard[event]] == [x for x, _ in points]
            assert [y for _, y in tensorboard[event]] == pytest.approx(
                [y for _, y in points], rel=1e-6
            )  # TensorBoard stores float32
    zero3_losses = [loss for _, loss in zero3["loss_curve"]]
    assert zero3_losses == pytest.approx(losses, rel=1e-3), (zero3_losses, losses)
    assert abs(zero3["final_test_accuracy"] - metrics["final_test_accuracy"]) <= 0.01


@pytest.mark.parametrize(
    "config, top_k, noisy, steps",
    # Two full training runs; every stage with these flags runs 20 steps in the API-sequence
    # tests below. Top-2 in bf16 learns faster per step and costs more per step (bf16 on the
    # CPU): 40 steps take its loss from 2.27 to 1.67 and its accuracy to 0.40 (top-1 with RSample
    # noise is at 0.85x its first loss after 40 steps: too near the bound, so 80).
    [
        ("ds_config_zero1_fp32.json", "1", "RSample", 80),
        ("ds_config_zero2_bf16.json", "2", "", 40),
    ],
)
def test_run_ds_moe_trains_with_experts_split_over_two_processes(
    tmp_path, config, top_k, noisy, steps
):
    # The tutorial's run_ds_moe.sh (2 processes, ep_size 2, 2 experts): each rank holds one
    # expert, reduced over its own expert-data-parallel group, the rest over both ranks.
    output_dir = tmp_path / "out"
    run = subprocess.run(
        ["bash", str(EXAMPLE_DIR / "run_ds_moe.sh"), "--epochs", "50", "--max-steps", str(steps),
         "--log-interval", "20", "--data-dir", str(tmp_path / "no_data_here"),
         "--output-dir", str(output_dir)],
        env=launch_env(PYTHON=PYTHON, MASTER_PORT=str(free_port()), CONFIG=config, TOP_K=top_k,
                       NOISY=noisy),
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "ep_size_2: gradients reduced" in run.stdout + run.stderr  # the experts' own set
    metrics = json.loads((output_dir / "metrics.json").read_text())
    losses = [loss for _, loss in metrics["loss_curve"]]
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < 0.85 * losses[0], losses
    assert metrics["final_test_accuracy"] > 0.2, metrics["final_test_accuracy"]  # chance: 0.1


def test_moe_noisy_gating_with_top_2_is_refused_by_name(tmp_path):
    run = subprocess.run(
        ["bash", str(EXAMPLE_DIR / "run_ds_moe.sh"), "--max-steps", "1",
         "--data-dir", str(tmp_path / "no_data_here"), "--output-dir", str(tmp_path / "out")],
        env=launch_env(PYTHON=PYTHON, MASTER_PORT=str(free_port()), TOP_K="2"),
        capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode != 0
    assert "noisy_gate_policy" in run.stdout + run.stderr


# ---- DeepSpeedExamples' CIFAR-10 API sequence ----------------------------------------------

SEQUENCE = REPO_ROOT / "tests" / "deepspeed_tutorial_sequence.py"
RUN_DS_MOE = ["--moe", "--ep-world-size", "2", "--num-experts", "2", "--moe-param-group"]


# Every stage in fp32 and bf16, with and without DeepSpeed's MoE parameter groups.
@pytest.mark.parametrize(
    "stage, dtype, extra",
    [
        (0, "fp32", []),
        (1, "fp32", ["--moe-param-group"]),
        (2, "fp32", []),
        (0, "bf16", ["--moe-param-group"]),
        (1, "bf16", []),
        (2, "bf16", ["--moe-param-group"]),
        (3, "fp32", ["--moe-param-group"]),
        (3, "bf16", []),
        # DeepSpeedExamples' run_ds_moe.sh flags: 2 experts split over the 2 ranks.
        *[
            (stage, "fp32", [*RUN_DS_MOE, "--top-k", "1", "--noisy-gate-policy", "RSample"])
            for stage in (0, 1, 2)
        ],
        (2, "bf16", [*RUN_DS_MOE, "--top-k", "2"]),
    ],
)
def test_deepspeed_examples_api_sequence(pool2, tmp_path, stage, dtype, extra):
    argv = ["--stage", str(stage), "--dtype", dtype, "--out", str(tmp_path), *extra]
    if (stage, dtype, extra) == (0, "fp32", []):
        # Once as the user runs it: its own processes, started by our launcher.
        run = launch(SEQUENCE, argv)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    else:
        # The other cases in the session's two gloo workers: the same script, without three
        # new Python processes (launcher and ranks, each importing torch) per case.
        from deepspeed_tutorial_sequence import run_in_pool

        pool2.run(run_in_pool, argv)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for result in results:
        assert result["micro_batch"] == 8  # train_batch_size 16 over 2 ranks
        assert result["bf16"] is (dtype == "bf16")
        assert result["param_dtype"] == ("torch.bfloat16" if dtype == "bf16" else "torch.float32")
        assert len(result["losses"]) == 20 and all(math.isfinite(x) for x in result["losses"])
        assert result["test_total"] == 200
        assert result["parameters"] != results[0]["initial_parameters"], "training moved nothing"
    if "--ep-world-size" in extra:  # each rank holds other experts; the rest must agree
        assert results[0]["parameters"] != results[1]["parameters"]
        assert results[0]["dense_parameters"] == results[1]["dense_parameters"], "ranks diverged"
    else:
        assert results[0]["parameters"] == results[1]["parameters"], "ranks diverged"


def test_deepspeed_examples_moe_flags_build_and_train(tmp_path):
    # A plain `python script.py` (a world of one, no launcher): the MoE layers (ep_size=1) are
    # built, their parameters split into DeepSpeed's MoE groups, and the engine trains.
    run = subprocess.run(
        [PYTHON, str(SEQUENCE), "--moe", "--moe-param-group", "--dtype", "fp32",
         "--out", str(tmp_path)],
        env=launch_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert len(result["losses"]) == 20 and all(math.isfinite(x) for x in result["losses"])
