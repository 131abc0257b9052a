"""The suite's one nvcc wheel build (DS_BUILD_FUSED_ADAM=1, test_fused_adam_build.py), done once
per session, by whichever asks first: tests/prebuild_ops.py in the session's background after the
CPU ops, or the test itself. Both build from a clean copy of the checkout (never in the source
tree, where test_op_loading.py's own pip builds run) into the session folder conftest.py names
in DS_TEST_BACKGROUND_DIR, holding a lock while they build; the second finds the result there.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

ARCH_LIST = "8.0;9.0+PTX"
SESSION_DIR = "DS_TEST_BACKGROUND_DIR"


def built_wheel(fallback_dir: Path) -> dict:
    """{"returncode", "stdout", "stderr", "wheels"}: the session's build, made now if nobody
    made it yet (in ``fallback_dir`` when there is no session folder)."""
    session = os.environ.get(SESSION_DIR)
    root = Path(session) / "fused_adam_wheel" if session else fallback_dir
    root.mkdir(parents=True, exist_ok=True)
    result_file = root / "result.json"
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # waits while the other one builds
        if not result_file.is_file():
            result = _build(root)
            partial = root / "result.json.partial"
            partial.write_text(json.dumps(result))
            partial.rename(result_file)
    return json.loads(result_file.read_text())


def _build(root: Path) -> dict:
    from conftest import copy_tracked_tree

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
