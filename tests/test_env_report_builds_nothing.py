"""The environment report compiles nothing unless asked (``--load``), and even then leaves CUDA
ops alone on a machine without a GPU unless ``DS_BUILD_<OP>=1`` asks for them: the main job
(scripts/run_main_job.sh) calls it without ``--load`` and its ops build on first use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_the_report_without_load_leaves_an_empty_jit_cache_empty(tmp_path):
    env = dict(os.environ, DS_CPP_EXTENSIONS_DIR=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "deepspeed_cpp.env_report"], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "cpu_adam" in run.stdout and "can JIT (not compiled)" in run.stdout, run.stdout
    built = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert built == [], built


def test_the_main_job_runs_the_report_without_load():
    script = (REPO / "scripts" / "run_main_job.sh").read_text()
    calls = [line for line in script.splitlines() if "deepspeed_cpp.env_report" in line]
    assert calls and all("--load" not in line for line in calls), calls


@pytest.mark.skipif(torch.cuda.is_available(), reason="declining CUDA builds needs no GPU")
def test_load_declines_cuda_ops_without_a_gpu_unless_asked(monkeypatch):
    from deepspeed_cpp.env_report import cuda_build_declined
    from deepspeed_cpp.ops.op_builder import CPUAdamBuilder, FusedAdamBuilder, MoECudaBuilder

    monkeypatch.delenv("DS_BUILD_FUSED_ADAM", raising=False)
    monkeypatch.delenv("DS_BUILD_MOE_CUDA", raising=False)
    assert "set DS_BUILD_FUSED_ADAM=1" in cuda_build_declined(FusedAdamBuilder())
    assert "set DS_BUILD_MOE_CUDA=1" in cuda_build_declined(MoECudaBuilder())
    assert cuda_build_declined(CPUAdamBuilder()) == ""
    monkeypatch.setenv("DS_BUILD_FUSED_ADAM", "1")
    assert cuda_build_declined(FusedAdamBuilder()) == ""
