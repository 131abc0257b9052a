"""``python -m deepspeed_cpp.compat -c CODE`` and ``-m MODULE``: the one-liners of the Hugging Face
DeepSpeed guide, run as written but for the interpreter's first words (real subprocesses)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT
from launch_helpers import launch_env

COMPAT = [sys.executable, "-m", "deepspeed_cpp.compat"]


def _compat(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*COMPAT, *args], env=launch_env(PYTHONPATH=str(REPO_ROOT)), cwd=cwd,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


# The guide's memory estimate (a small model in place of the downloaded T0_3B), then what
# `python -c` would give the code: its argv, __name__, sys.path[0], and the aliased package.
GUIDE_ONE_LINER = (
    "import json, sys, torch; "
    "from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_live; "
    "model = torch.nn.Sequential(torch.nn.Linear(1000, 1000), torch.nn.Linear(1000, 10)); "
    "estimate_zero3_model_states_mem_needs_all_live(model, num_gpus_per_node=2, num_nodes=1); "
    "import deepspeed; "
    "print(json.dumps({'argv': sys.argv, 'name': __name__, 'path0': sys.path[0], "
    "'main': sys.modules['__main__'].__dict__ is globals(), 'package': deepspeed.__name__}))"
)


def test_dash_c_runs_the_guides_estimator_one_liner(tmp_path):
    done = _compat("-c", GUIDE_ONE_LINER, "first", "-x", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Estimated memory needed for params, optim states and gradients" in done.stdout
    assert "1 node, 2 GPUs per node" in done.stdout
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {
        "argv": ["-c", "first", "-x"],
        "name": "__main__",
        "path0": "",
        "main": True,
        "package": "deepspeed_cpp",
    }


def test_dash_c_reports_errors_as_python_does(tmp_path):
    failed = _compat("-c", "import deepspeed\nraise ValueError('from the code')", cwd=tmp_path)
    assert failed.returncode == 1
    assert 'File "<string>", line 2' in failed.stderr
    assert "ValueError: from the code" in failed.stderr
    exited = _compat("-c", "import sys; sys.exit(3)", cwd=tmp_path)
    assert exited.returncode == 3
    missing = _compat("-c", cwd=tmp_path)
    assert missing.returncode != 0
    assert missing.stderr.strip().splitlines() == [
        "python -m deepspeed_cpp.compat: -c expects an argument; usage: python -m "
        "deepspeed_cpp.compat [SCRIPT | -m MODULE | -c CODE] [ARGS...]"
    ]


def test_dash_m_runs_an_aliased_deepspeed_module(tmp_path):
    # runpy asks the module's loader for its code: the alias loader hands over deepspeed_cpp's.
    done = _compat("-m", "deepspeed.utils.zero_to_fp32", "--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m deepspeed_cpp.utils.zero_to_fp32")
    # A user's own module importing deepspeed, run with -m from the working directory.
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "__init__.py").write_text("")
    (tmp_path / "mine" / "job.py").write_text(
        "import json, sys, deepspeed.utils.zero_to_fp32 as z\n"
        "print(json.dumps([__name__, sys.argv[1:], z.__name__, __file__]))\n"
    )
    done = _compat("-m", "mine.job", "--flag", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [
        "__main__",
        ["--flag"],
        "deepspeed_cpp.utils.zero_to_fp32",
        str(tmp_path / "mine" / "job.py"),
    ]
    missing = _compat("-m", "deepspeed.no_such_module", cwd=tmp_path)
    assert missing.returncode != 0
    assert "'deepspeed_cpp.no_such_module'" in missing.stderr
