"""An HF Trainer script (examples/hf_trainer) run as users run it: `--deepspeed ds_config.json`
through HfArgumentParser, with no launcher (a world of one) and with our launcher (2 processes,
which passes --local_rank as DeepSpeed's does); the two give the same losses for the same global
batch."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch_helpers import free_port, launch_env

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = REPO_ROOT / "examples" / "hf_trainer"


def _script_arguments(output_dir: Path, micro: int) -> list[str]:
    return [
        str(EXAMPLE / "train_tiny_gpt2.py"),
        "--deepspeed", str(EXAMPLE / "ds_config.json"),
        "--output_dir", str(output_dir),
        "--per_device_train_batch_size", str(micro),
        "--max_steps", "4",
        "--learning_rate", "1e-3",
        "--logging_steps", "1",
        "--save_strategy", "no",
        "--report_to", "none",
        "--disable_tqdm", "true",
        "--dataloader_pin_memory", "false",
    ]  # fmt: skip


def _start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        env=launch_env(PYTHONPATH=str(REPO_ROOT)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO_ROOT,
    )


def _finish(run: subprocess.Popen) -> None:
    try:
        output, _ = run.communicate(timeout=400)
    except subprocess.TimeoutExpired:
        run.kill()
        output, _ = run.communicate()
    assert run.returncode == 0, output[-8000:]


def test_script_alone_and_under_our_launcher_agree(tmp_path):
    # The two runs are independent: started together, the one-process run's interpreter start
    # overlaps the launcher's (on 2 cores most of either is importing torch and transformers).
    launcher = [sys.executable, "-m", "deepspeed_cpp.launcher", "--num_procs", "2"]
    runs = [
        _start([sys.executable, *_script_arguments(tmp_path / "one", micro=8)]),
        _start(
            [*launcher, "--master_port", str(free_port()), *_script_arguments(tmp_path / "two", 4)]
        ),
    ]
    try:
        for run in runs:
            _finish(run)
    finally:
        # One failed: the other is not left behind (the launcher has exec'd torchrun, which
        # stops its workers on SIGTERM).
        for run in runs:
            if run.poll() is None:
                run.terminate()
                run.wait(timeout=60)
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert len(one["losses"]) == 4
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    # save_model() at ZeRO-3 wrote the whole model once.
    assert (tmp_path / "two" / "model.safetensors").is_file()
