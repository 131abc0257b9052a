"""Helpers of the aio and swap-file tests (test_aio*.py, test_swap_file*.py): an error message
naming what it must, random payloads of any dtype (every byte value for uint8), and for the aio
files a file's bytes read the plain way, a fresh folder, and a script's JSON result from a fresh
interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import torch


def assert_names(message, *parts):
    for part in parts:
        assert part in message, f"{part!r} missing from: {message}"


def random_payload(numel, dtype):
    if dtype == torch.uint8:
        return torch.randint(0, 256, (numel,), dtype=torch.uint8)
    return torch.randn(numel).to(dtype)


def random_bytes(n):
    return random_payload(n, torch.uint8)


def file_bytes(path, offset=0, n=None):
    with open(path, "rb") as file:  # buffered: an independent path to the same bytes
        file.seek(offset)
        return file.read() if n is None else file.read(n)


def temp_folder_in(folder):
    return tempfile.mkdtemp(dir=folder, prefix="deepspeed_cpp_aio_")


def run_python(script, *args, prefix=(), env=None, check=True, timeout=300):
    """Runs ``script`` (dedented) in a fresh interpreter after ``prefix`` (a command that changes
    the process: a namespace, dropped privileges); returns the finished process and the JSON of
    its last output line (None without output). ``check``: the process must exit with 0."""
    result = subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(script), *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **(env or {})),
    )  # fmt: skip
    if check:
        assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    lines = result.stdout.strip().splitlines()
    return result, (json.loads(lines[-1]) if lines else None)


def run_python_json(script, *args, prefix=(), env=None):
    """``run_python``'s JSON result of a script that must succeed."""
    return run_python(script, *args, prefix=prefix, env=env)[1]
