"""Helpers for tests that start real processes: through the launcher (a free port, a clean
environment), or a Python command line of this checkout (``start_python``, several at once with
``run_module_at_once``)."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
ZERO_TO_FP32 = "deepspeed_cpp.utils.zero_to_fp32"  # the recovery command's module

# Variables a parent test process might carry that must not leak into a fresh launch.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A port nobody listens on now (the kernel picks it), so parallel runs never collide."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_env(**overrides) -> dict:
    """This process's environment without launcher variables, one OpenMP thread per worker."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **overrides)
    for name in LAUNCH_VARIABLES:
        env.pop(name, None)
    return env


def finish(started, timeout: float = 300):
    """``started`` (a text-mode ``subprocess.Popen`` with piped output) waited for, as a
    ``CompletedProcess``; killed if it outlives ``timeout`` or the wait is interrupted."""
    try:
        out, err = started.communicate(timeout=timeout)
    finally:
        if started.poll() is None:
            started.kill()
            started.wait()
    return subprocess.CompletedProcess(started.args, started.returncode, out, err)


def start_python(*args: str, cwd, **env) -> subprocess.Popen:
    """``python *args`` started in ``cwd`` with this checkout on its path (text output piped)."""
    return subprocess.Popen(
        [sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=launch_env(**{"PYTHONPATH": str(REPO_ROOT), **env}),
    )  # fmt: skip


def run_module_at_once(module: str, *commands: tuple[str, ...], cwd) -> list:
    """``python -m module *command`` for each of ``commands``, started together and finished in
    order: each is mostly an interpreter importing torch, one core each, so two cores run two
    at a time."""
    started = [start_python("-m", module, *command, cwd=cwd) for command in commands]
    return [finish(process) for process in started]
