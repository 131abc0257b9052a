"""Helpers for tests that start real processes through the launcher."""

import os
import socket

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
    import subprocess

    try:
        out, err = started.communicate(timeout=timeout)
    finally:
        if started.poll() is None:
            started.kill()
            started.wait()
    return subprocess.CompletedProcess(started.args, started.returncode, out, err)
