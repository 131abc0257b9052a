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


def _run(command: list[str]) -> dict:
    run = subprocess.run(
        command,
        env=launch_env(PYTHONPATH=str(REPO_ROOT)),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run


def test_script_alone_and_under_our_launcher_agree(tmp_path):
    _run([sys.executable, *_script_arguments(tmp_path / "one", micro=8)])
    launcher = [sys.executable, "-m", "deepspeed_cpp.launcher", "--num_procs", "2"]
    _run([*launcher, "--master_port", str(free_port()), *_script_arguments(tmp_path / "two", 4)])
    one = json.loads((tmp_path / "one" / "summary.json").read_text())
    two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert one["world_size"] == 1 and two["world_size"] == 2
    assert len(one["losses"]) == 4
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    # save_model() at ZeRO-3 wrote the whole model once.
    assert (tmp_path / "two" / "model.safetensors").is_file()
