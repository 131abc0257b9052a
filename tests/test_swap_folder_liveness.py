"""Swap folders of a live job survive another job's stale-folder sweep, even when that job
cannot see the live job's pid (another PID namespace on the same host name); folders of jobs
that are gone are still removed."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT

from deepspeed_cpp.runtime.zero.offload import SwapFolder, remove_stale_folders, stale_swap_folders

pytestmark = pytest.mark.usefixtures("aio_library")  # compiled before any subprocess needs it


def _pid_namespace_prefix():
    """A command prefix running its command as pid 1 of a new PID namespace (with its own
    /proc), or None where this machine allows none."""
    if shutil.which("unshare") is None:
        return None
    pid_ns = ["--pid", "--fork", "--mount-proc"]
    variants = [["unshare", *pid_ns], ["unshare", "--user", "--map-root-user", *pid_ns]]
    for prefix in variants if os.geteuid() == 0 else variants[1:]:
        probe = subprocess.run([*prefix, "sh", "-c", "echo $$"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == "1":
            return prefix
    return None


_LIVE_JOB = """
import json, sys, torch
from deepspeed_cpp.runtime.zero.offload import SwapFolder
folder = SwapFolder(sys.argv[1], purpose="optimizer", rank=0)
state = torch.arange(50_000, dtype=torch.float32)
folder.write("group0", state).wait()
print(json.dumps({"folder": str(folder.folder)}), flush=True)
sys.stdin.readline()  # the other job sweeps meanwhile
back = torch.empty_like(state)
folder.read("group0", into=back).wait()
print(json.dumps({"same": bool(torch.equal(back, state))}), flush=True)
folder.close()
"""

_OTHER_JOB = """
import json, os, sys
from deepspeed_cpp.runtime.zero.offload import SwapFolder
live_pid = int(sys.argv[2])
try:
    os.kill(live_pid, 0)
    sees_live_pid = True
except ProcessLookupError:
    sees_live_pid = False
folder = SwapFolder(sys.argv[1], purpose="optimizer", rank=0)
print(json.dumps({"my_pid": os.getpid(), "sees_live_pid": sees_live_pid}), flush=True)
folder.close()
"""


def _other_job(prefix, nvme, live_pid):
    result = subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(_OTHER_JOB), str(nvme), str(live_pid)],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_job_in_another_pid_namespace_keeps_a_live_jobs_folder_and_removes_a_dead_ones(nvme):
    prefix = _pid_namespace_prefix()
    if prefix is None:
        pytest.skip("no PID namespace here (unshare); the locked-folder test covers the rule")
    live = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_LIVE_JOB), str(nvme)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    try:
        folder = Path(json.loads(live.stdout.readline())["folder"])
        other = _other_job(prefix, nvme, live.pid)
        # The sweep ran where the live job's pid means nothing, on the same host name.
        assert other["my_pid"] == 1 and not other["sees_live_pid"], other
        assert folder.is_dir() and (folder / "group0.swp").is_file()
        live.stdin.write("go on\n")
        live.stdin.flush()
        assert json.loads(live.stdout.readline()) == {"same": True}
        assert live.wait(timeout=60) == 0, live.stderr.read()
    finally:
        live.kill()
        live.wait()
    # A job that died (SIGKILL, nothing cleaned up) in the first namespace: its lock went with
    # it, and a job in another namespace removes its folder.
    dead = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_LIVE_JOB), str(nvme)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    dead_folder = Path(json.loads(dead.stdout.readline())["folder"])
    dead.send_signal(signal.SIGKILL)
    dead.wait()
    assert dead_folder.is_dir()
    _other_job(prefix, nvme, dead.pid)
    assert not dead_folder.exists()
    assert os.listdir(nvme / stale_swap_folders.ROOT_NAME) == []


_LOCK_HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""


def test_a_folder_whose_owner_lock_is_held_is_never_removed(nvme):
    """The rule without namespaces: the folder names a pid this process cannot see (as a job in
    another PID namespace would), and a live process holds its owner lock."""
    made = SwapFolder(nvme, purpose="optimizer", rank=3)
    made.write("k", torch.ones(10)).wait()
    made.close()
    root = nvme / stale_swap_folders.ROOT_NAME
    unseen_pid = (1 << 22) + os.getpid()  # above pid_max's ceiling (2^22): never a pid here
    name = f"optimizer-{stale_swap_folders.host_name()}-pid{unseen_pid}-rank0-{'c' * 16}"
    folder = root / name
    folder.mkdir()
    owner = {"pid": unseen_pid, "start_time": 12345, "run_id": "c" * 16, "liveness": "flock"}
    (folder / "owner").write_text(json.dumps(owner))
    (folder / "group0.swp").write_bytes(b"\0" * 8192)
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_LOCK_HOLDER), str(folder / "owner")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert remove_stale_folders(nvme) == []
        SwapFolder(nvme, purpose="optimizer", rank=0).close()
        assert sorted(os.listdir(folder)) == ["group0.swp", "owner"]
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    # The holder is gone, its lock with it: now the folder is stale.
    assert remove_stale_folders(nvme) == [folder]
    assert os.listdir(root) == []


def test_an_owner_file_that_is_a_symlink_or_not_a_file_is_left_alone(nvme, tmp_path):
    root = nvme / stale_swap_folders.ROOT_NAME
    root.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep")
    host = stale_swap_folders.host_name()
    linked = root / f"optimizer-{host}-pid5000000-rank0-{'d' * 16}"
    linked.mkdir()
    (linked / "owner").symlink_to(target)
    fifo = root / f"optimizer-{host}-pid5000001-rank0-{'e' * 16}"
    fifo.mkdir()
    os.mkfifo(fifo / "owner")
    # In a process of its own: opening a FIFO to read it would wait for a writer forever.
    sweep = "import sys; from deepspeed_cpp.runtime.zero.offload import remove_stale_folders as r"
    sweep += "; print(r(sys.argv[1]))"
    result = subprocess.run(
        [sys.executable, "-c", sweep, str(nvme)], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    assert result.returncode == 0 and result.stdout.strip() == "[]", result
    assert (linked / "owner").is_symlink() and target.read_text() == "keep"
    assert (fifo / "owner").exists()
