"""The suite's one nvcc wheel build (DS_BUILD_FUSED_ADAM=1, test_fused_adam_build.py), done once
per session (tests/session_builds.py), by whichever asks first: tests/prebuild_ops.py in the
session's background after the CPU ops, or the test itself. Built from a clean copy of the
checkout (never in the source tree, where test_op_loading.py's own pip builds run).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from session_builds import built_once, copy_tracked_tree

ARCH_LIST = "8.0;9.0+PTX"


def built_wheel(fallback_dir: Path) -> dict:
    """{"returncode", "stdout", "stderr", "wheels"}: the session's build, made now if nobody
    made it yet (in ``fallback_dir`` when there is no session folder)."""
    return built_once("fused_adam_wheel", _build, fallback_dir)


def _build(root: Path) -> dict:
    source = copy_tracked_tree(root / "source")
    wheels = root / "wheels"
    env = dict(os.environ, DS_BUILD_FUSED_ADAM="1", TORCH_CUDA_ARCH_LIST=ARCH_LIST)
    env.pop("DS_BUILD_OPS", None)
    # MAX_JOBS comes from the environment (setup.py derives it from cores and memory if unset).
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w",
         str(wheels), str(source)],
        env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    return {
        "returncode": built.returncode,
        "stdout": built.stdout[-4000:],
        "stderr": built.stderr[-4000:],
        "wheels": str(wheels),
    }
