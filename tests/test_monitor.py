"""Monitors (issue 30): DeepSpeed's tensorboard / csv_monitor / comet sections on 2 gloo ranks
write the engine's own losses, learning rates and loss scales, from rank 0 only, read back with
each back-end's own reader (comet: its offline archive); a missing back-end package is a named
error on every rank."""

from __future__ import annotations

import csv
import json
import os
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from monitor_training import GAS, MICRO, STEPS, assert_points, train_with_monitors

from deepspeed_cpp.monitor import MissingMonitorPackageError, MonitorMaster
from deepspeed_cpp.runtime.config import DeepSpeedConfig


def _read_csv(path: Path) -> tuple[list[str], list[tuple[int, float]]]:
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    return rows[0], [(int(step), float(value)) for step, value in rows[1:]]


def _read_tensorboard(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return {
        tag: [(event.step, event.value) for event in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
    }


@pytest.mark.parametrize("stage, fp16", [(2, False), (3, True)])
def test_rank0_writes_engine_losses_and_lrs(pool2, tmp_path, stage, fp16):
    pytest.importorskip("tensorboard")
    results = pool2.run(train_with_monitors, str(tmp_path), stage, fp16)
    losses, lrs, scales, batch = results[0]
    assert not (tmp_path / "rank1").exists(), "rank 1 must not write monitor files"
    # DeepSpeed's cadence: the loss at the samples seen before the step, lr (and loss scale)
    # at those seen after it.
    loss_points = [(batch * i, loss) for i, loss in enumerate(losses)]
    lr_points = [(batch * (i + 1), lr) for i, lr in enumerate(lrs)]
    scale_points = [(batch * (i + 1), s) for i, s in enumerate(scales)]

    csv_dir = tmp_path / "rank0" / "csv_job"
    expected_files = {"Train_Samples_train_loss.csv", "Train_Samples_lr.csv"}
    if fp16:
        expected_files.add("Train_Samples_loss_scale.csv")
    assert {p.name for p in csv_dir.iterdir()} == expected_files
    header, rows = _read_csv(csv_dir / "Train_Samples_train_loss.csv")
    assert header == ["step", "train_loss"]
    assert_points(rows, loss_points, rel=1e-6)
    header, rows = _read_csv(csv_dir / "Train_Samples_lr.csv")
    assert header == ["step", "lr"]
    assert_points(rows, lr_points, rel=1e-12)

    scalars = _read_tensorboard(tmp_path / "rank0" / "tb_job")
    expected_tags = {"Train/Samples/train_loss", "Train/Samples/lr"}
    if fp16:
        expected_tags.add("Train/Samples/loss_scale")
        assert_points(scalars["Train/Samples/loss_scale"], scale_points, rel=0)
    assert set(scalars) == expected_tags
    # TensorBoard stores float32.
    assert_points(scalars["Train/Samples/train_loss"], loss_points, rel=1e-6)
    assert_points(scalars["Train/Samples/lr"], lr_points, rel=1e-6)


def test_write_events_for_user_scalars(tmp_path):
    config = DeepSpeedConfig.parse(
        {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "j"}}
    )
    monitor = MonitorMaster(config, rank=0)
    monitor.write_events([("Train/Eval/accuracy", 0.5, 10), ("my loss", torch.tensor(2.0), 10)])
    monitor.write_events([("Train/Eval/accuracy", 0.75, 20)])
    assert _read_csv(tmp_path / "j" / "Train_Eval_accuracy.csv") == (
        ["step", "accuracy"],
        [(10, 0.5), (20, 0.75)],
    )
    assert _read_csv(tmp_path / "j" / "my_loss.csv") == (["step", "my loss"], [(10, 2.0)])
    # Other ranks build no back-end and write nothing.
    other = MonitorMaster(config, rank=1)
    assert other.enabled and other.monitors == []


def test_missing_package_is_a_named_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    config = DeepSpeedConfig.parse({"wandb": {"enabled": True}})
    for rank in (0, 1):  # every rank, not only the writing one
        with pytest.raises(
            MissingMonitorPackageError, match=r"'wandb' section .*pip install wandb"
        ):
            MonitorMaster(config, rank=rank)


def test_disabled_monitors_import_nothing():
    config = DeepSpeedConfig.parse({})
    monitor = MonitorMaster(config, rank=0)
    assert not monitor.enabled and monitor.monitors == []


def _train_with_timers(root: str, stage: int):
    import logging

    import deepspeed_cpp as deepspeed

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = Collect()
    logging.getLogger("deepspeed_cpp").addHandler(handler)
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 2,
        "wall_clock_breakdown": True,
        "memory_breakdown": True,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        # Threshold 0: every ZeRO-3 parameter is partitioned, so every forward gathers.
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "csv_monitor": {"enabled": True, "output_path": root, "job_name": "timers"},
        "flops_profiler": {
            "enabled": True,
            "profile_step": 1,
            "output_file": os.path.join(root, f"flops_rank{dist.get_rank()}.txt"),
        },
    }
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    timer = engine.tput_timer
    # DeepSpeed's throughput timer: untimed until start_step optimizer steps are done.
    timed_from = timer.start_step * GAS
    outer = 0.0  # seconds around the timed micro-steps, measured here
    try:
        for micro in range(STEPS * GAS):
            begin = time.time()
            engine.backward(engine(torch.randn(MICRO, 5)).pow(2).mean())
            assert timer.started and (timer.start_time > 0) == (micro >= timed_from), micro
            engine.step()
            if micro >= timed_from:
                outer += time.time() - begin
            assert not timer.started and timer.micro_step_count == micro + 1
            assert timer.global_step_count == (micro + 1) // GAS
    finally:
        logging.getLogger("deepspeed_cpp").removeHandler(handler)
        engine.destroy()
    assert 0 < timer.total_elapsed_time <= outer  # its spans lie inside ours
    speed = timer.batch_size * (STEPS - timer.start_step) / timer.total_elapsed_time
    throughput = (timer.batch_size, timer.avg_samples_per_sec(), speed, timer.step_elapsed_time)
    return [line for line in lines if line.startswith("time (ms)")], throughput


# ZeRO-3's timers that every step of this model runs (backward_all_gather only where a unit
# was released between its forward and its backward, which the schedule decides).
ZERO3_TIMERS_RUN = ("forward_fetch_submit", "forward_all_gather", "forward_fetch_wait",
                    "backward_fetch_submit", "backward_fetch_wait", "reduce_scatter_submit",
                    "reduce_scatter_wait", "optimizer_step")  # fmt: skip


def _profile_seconds(profile: str, phase: str) -> float:
    """``<phase> latency:`` of a flops profile (DeepSpeed's "12.3 ms" format) in seconds."""
    value, unit = profile.split(f"{f'{phase} latency:':<60}")[1].split()[:2]
    return float(value) * {"s": 1.0, "ms": 1e-3, "us": 1e-6}[unit]


def _timer_values(line: str) -> dict[str, float]:
    parts = [part.split(": ") for part in line.split(" | ")[1:]]
    return {name: float(value.split()[0]) for name, value in parts}


@pytest.mark.parametrize("stage", [2, 3])
def test_wall_clock_breakdown_logs_deepspeed_timers(pool2, tmp_path, stage):
    results = pool2.run(_train_with_timers, str(tmp_path), stage)
    lines = [lines for lines, _ in results]
    for batch_size, average, speed, step_elapsed in (throughput for _, throughput in results):
        assert batch_size == MICRO * GAS * 2  # engine.tput_timer: samples per optimizer step
        assert average == pytest.approx(speed, rel=1e-12) and average > 0
        assert step_elapsed == 0  # reset at every boundary
    assert lines[1] == []  # rank 0 logs
    micro = [line for line in lines[0] if "fwd_microstep" in line]
    global_ = [line for line in lines[0] if "| fwd:" in line]
    assert len(micro) == STEPS * GAS  # every step() call, as DeepSpeed
    for name in ("fwd_microstep", "bwd_microstep", "bwd_inner_microstep",
                 "bwd_allreduce_microstep", "step_microstep", "host_rss"):  # fmt: skip
        assert f"| {name}: " in micro[-1], (name, micro[-1])
    assert len(global_) == STEPS // 2  # every steps_per_print optimizer steps
    for name in ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step"):
        assert f"| {name}: " in global_[-1]
    # The monitors get DeepSpeed's elapsed-time events at every boundary.
    names = {p.name for p in (tmp_path / "timers").iterdir()}
    for event in ("forward", "backward", "backward_inner", "backward_allreduce", "step"):
        assert f"Train_Samples_elapsed_time_ms_{event}.csv" in names
    _, rows = _read_csv(tmp_path / "timers" / "Train_Samples_elapsed_time_ms_forward.csv")
    assert len(rows) == STEPS and all(value > 0 for _, value in rows)
    # flops_profiler: rank 0 profiles step 1's forward: MICRO x (5*7 + 7*1) multiply-adds.
    assert not (tmp_path / "flops_rank1.txt").exists()
    profile = (tmp_path / "flops_rank0.txt").read_text()
    assert "Profile Summary at step 2:" in profile  # DeepSpeed: the step count after step 1
    assert f"{'fwd MACs per GPU:':<60}{MICRO * (5 * 7 + 7 * 1)} MACs" in profile
    # DeepSpeed's engine lines: the profiled step's latencies, iter = fwd + bwd + step.
    seconds = {name: _profile_seconds(profile, name) for name in ("fwd", "bwd", "step", "iter")}
    assert all(value > 0 for value in seconds.values()), seconds
    iteration = seconds["fwd"] + seconds["bwd"] + seconds["step"]
    assert seconds["iter"] == pytest.approx(iteration, rel=0.01, abs=2e-5), seconds
    samples = float(profile.split(f"{'samples/second:':<60}")[1].split()[0])
    assert samples == pytest.approx(MICRO * 2 / seconds["iter"], rel=0.02), (samples, seconds)
    # ZeRO-3: its gathers, gradient reduce-scatters and optimizer step, at every boundary, each
    # with time spent in it (a line per optimizer step; none at stage 2).
    zero3 = [_timer_values(line) for line in lines[0] if "| forward_fetch_submit:" in line]
    if stage != 3:
        assert zero3 == [] and not any("reduce_scatter" in line for line in lines[0])
        return
    assert len(zero3) == STEPS, lines[0]
    for name in ZERO3_TIMERS_RUN:
        assert all(name in values for values in zero3), (name, zero3)
        # Summed over the run: a quick one (a wait for a gather already done) may print 0.00 ms.
        assert sum(values[name] for values in zero3) > 0.0, (name, zero3)
    assert all(values["forward_fetch_submit"] > 0.0 for values in zero3), zero3


# --- comet, offline ----------------------------------------------------------------------------

# Set in the worker, where comet_ml reads them: the archive under the test's folder, and none of
# the environment, git, console or system-metrics logging an offline test does not look at.
_COMET_QUIET = {
    "COMET_AUTO_LOG_ENV_DETAILS": "false",
    "COMET_AUTO_LOG_GIT_METADATA": "false",
    "COMET_AUTO_LOG_GIT_PATCH": "false",
    "COMET_AUTO_LOG_OUTPUT_LOGGER": "false",
    "COMET_AUTO_LOG_ENV_CPU": "false",
    "COMET_AUTO_LOG_ENV_HOST": "false",
    "COMET_AUTO_LOG_ENV_GPU": "false",
    "COMET_AUTO_LOG_ENV_NETWORK": "false",
    "COMET_AUTO_LOG_ENV_DISK": "false",
    "COMET_DISABLE_AUTO_LOGGING": "1",
}


# comet_ml is installed in a folder of its own (scripts/setup_env.sh), put on the path only here:
# transformers and accelerate import it in every process where it is importable. Appended, so
# the packages it shares with the venv come from the venv.
COMET_FOLDER = str(Path(sys.prefix) / "monitor-extras")


def _comet_importable() -> None:
    if COMET_FOLDER not in sys.path:
        sys.path.append(COMET_FOLDER)


def _train_comet_offline(root: str, interval: int):
    _comet_importable()
    before = dict(os.environ)
    os.environ.update(_COMET_QUIET, COMET_OFFLINE_DIRECTORY=os.path.join(root, "comet"))
    section = {
        "enabled": True,
        "online": False,
        "project": "ds_cpp_test",
        "experiment_name": "zero3_fp16",
        "samples_log_interval": interval,
    }
    try:
        return train_with_monitors(root, 3, True, monitors={"comet": section})
    finally:
        os.environ.clear()
        os.environ.update(before)


def _read_comet_archive(path) -> tuple[dict, dict, dict[str, list[tuple[int, float]]]]:
    """The experiment record, its "other" values (the name) and, per metric, its (step, value)
    points in logged order."""
    with zipfile.ZipFile(path) as archive:
        experiment = json.loads(archive.read("experiment.json"))
        lines = archive.read("messages.json").decode().splitlines()
    curves: dict[str, list[tuple[int, float]]] = {}
    others = {}
    for line in lines:
        message = json.loads(line)
        if message["type"] == "log_other":
            others[message["payload"]["key"]] = message["payload"]["value"]
        if message["type"] == "metric_msg":
            metric = message["payload"]["metric"]
            points = curves.setdefault(metric["metricName"], [])
            points.append((metric["step"], float(metric["metricValue"])))
    return experiment, others, curves


def test_comet_offline_archive_holds_the_engine_curves(pool2, tmp_path):
    """Rank 0 alone starts a Comet ``OfflineExperiment`` (``online: false``: no account, no
    network); its archive (the zip ``comet upload`` would send) holds the engine's curves at
    DeepSpeed's sample steps, thinned by ``samples_log_interval``, under the config's project
    and experiment name (ZeRO-3, fp16)."""
    _comet_importable()
    pytest.importorskip("comet_ml")
    batch = 3 * GAS * 2  # MICRO x GAS x world size
    results = pool2.run(_train_comet_offline, str(tmp_path), 2 * batch)
    losses, lrs, scales, train_batch = results[0]
    assert train_batch == batch
    archives = list((tmp_path / "comet").glob("*.zip"))
    assert len(archives) == 1, archives  # rank 0's only
    experiment, others, curves = _read_comet_archive(archives[0])
    assert experiment["project_name"] == "ds_cpp_test"
    assert others["Name"] == "zero3_fp16" and others["offline_experiment"] is True
    engine_curves = {name: points for name, points in curves.items() if name.startswith("Train/")}
    assert set(engine_curves) == {
        "Train/Samples/train_loss",
        "Train/Samples/lr",
        "Train/Samples/loss_scale",
    }
    # DeepSpeed's steps (the loss at the samples seen before the step, lr and loss scale at
    # those after it), each name logged only once samples_log_interval (two steps' samples)
    # have passed since its last point: every other step, from the first.
    assert len(losses) == STEPS and GAS > 1 and STEPS % 2 == 0
    loss_points = [(batch * i, loss) for i, loss in enumerate(losses)][::2]
    lr_points = [(batch * (i + 1), lr) for i, lr in enumerate(lrs)][::2]
    scale_points = [(batch * (i + 1), scale) for i, scale in enumerate(scales)][::2]
    assert_points(engine_curves["Train/Samples/train_loss"], loss_points, rel=1e-6)
    assert_points(engine_curves["Train/Samples/lr"], lr_points, rel=1e-12)
    assert_points(engine_curves["Train/Samples/loss_scale"], scale_points, rel=0)


@pytest.mark.parametrize("backend", ["csv_monitor", "tensorboard"])
def test_plot_draws_a_runs_curves(tmp_path, backend):
    pytest.importorskip("matplotlib")
    if backend == "tensorboard":
        pytest.importorskip("tensorboard")
    from deepspeed_cpp.plot import read_run
    from deepspeed_cpp.plot.__main__ import main

    config = DeepSpeedConfig.parse(
        {backend: {"enabled": True, "output_path": str(tmp_path), "job_name": "run"}}
    )
    monitor = MonitorMaster(config, rank=0)
    for step in range(1, 6):
        monitor.write_events(
            [
                ("Train/Samples/train_loss", 1.0 / step, 8 * step),
                ("Train/Samples/lr", 0.1 * step, 8 * step),
            ]
        )
    monitor.write_events([("Train/Eval/test_accuracy", 0.5, 40)])  # the script's own scalar
    monitor.close()
    curves = read_run(tmp_path / "run")
    assert set(curves) == {
        "Train/Samples/train_loss", "Train/Samples/lr", "Train/Eval/test_accuracy"
    }  # fmt: skip
    assert curves["Train/Eval/test_accuracy"] == [(40.0, 0.5)]
    # A resumed run appends to the files, its header again: the curve goes on.
    MonitorMaster(config, rank=0).write_events([("Train/Eval/test_accuracy", 0.75, 80)])
    if backend == "csv_monitor":
        assert read_run(tmp_path / "run")["Train/Eval/test_accuracy"] == [(40.0, 0.5), (80.0, 0.75)]
    assert_points(curves["Train/Samples/lr"], [(8 * s, 0.1 * s) for s in range(1, 6)], 1e-6)
    out = tmp_path / "curves.png"
    assert main([str(tmp_path / "run"), "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "missing")]) == 1
