"""Swap folders of runs that died, and the lock that tells a live folder from a dead one.

Each ``SwapFolder`` holds an exclusive ``flock`` on its ``owner`` file for its whole life (the
kernel drops it when the process ends, however it ends). A new ``SwapFolder`` removes the folders
under the same ``nvme_path`` that are named as ours, were made on this host, and whose owner lock
it can take. The lock, not the pid, is what decides: a pid means nothing to a job in another PID
namespace (two containers with host networking, two pods sharing one local NVMe see the same
host name), while a lock on the file is seen by every process that can open it. A folder whose
lock is held is never removed. The host name check stays, so that a file system shared between
hosts whose locks are local to each (NFS with ``local_lock``) never loses another host's folder.

Folders made by versions that did not lock (their ``owner`` file has no ``"liveness": "flock"``)
are judged as before: dead when their pid is gone or was reused by a later process.

A folder is made under a name the sweep ignores (``<name>.new``), its owner file is created and
locked, and only then is it renamed to its final name: a sweep never sees a folder of ours
without its lock held. (A process that dies inside those few system calls leaves a
``<name>.new`` folder with at most the owner file in it; it is never removed automatically.)
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import stat
from pathlib import Path

from ....utils.logging import logger
from .swap_header import SUFFIX

ROOT_NAME = "deepspeed_cpp_swap"
OWNER_FILE = "owner"
MAKING_SUFFIX = ".new"
LIVENESS = "flock"
RUN_ID_HEX = 16  # run_id: 16 random hex digits
PURPOSE = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")
_FOLDER_NAME = re.compile(
    r"(?P<prefix>.+)-pid(?P<pid>[0-9]+)-rank(?P<rank>[0-9]+)-(?P<run_id>[0-9a-f]{"
    + str(RUN_ID_HEX)
    + "})"
)
_OPEN_OWNER = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            return int(stat_file.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def make_owned_folder(root: Path, name: str, owner: dict) -> tuple[Path, int]:
    """Makes ``root/name`` holding an ``owner`` file (`owner` as JSON) whose lock this process
    holds; returns the folder and the descriptor that holds the lock (close it to release).
    Raises OSError (after removing what it made) when a step fails."""
    making = root / (name + MAKING_SUFFIX)
    making.mkdir(mode=0o700)
    fd = -1
    try:
        fd = os.open(
            making / OWNER_FILE,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps(dict(owner, liveness=LIVENESS)).encode())
        folder = root / name
        os.rename(making, folder)
        return folder, fd
    except BaseException:
        if fd >= 0:
            os.close(fd)
        shutil.rmtree(making, ignore_errors=True)
        raise


def _process_alive(pid: int, start_time: int | None) -> bool:
    """Whether process `pid` runs (not a zombie) and is the one that started at `start_time`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            state = stat_file.read().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return False
    except (OSError, IndexError):
        pass
    if start_time is not None:
        now = process_start_time(pid)
        if now is not None and now != start_time:
            return False  # the pid was reused by another process
    return True


def _is_ours(name: str) -> bool:
    """Files that a SwapFolder makes in its folder (nothing else is ever deleted)."""
    return name == OWNER_FILE or name.endswith(SUFFIX)


def remove_folder(folder: Path) -> tuple[int, int, list[str]]:
    """Deletes our files in `folder`, then the folder if that left it empty; returns (files,
    bytes, names of what was kept)."""
    files, size, kept = 0, 0, []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0, 0, []
    for entry in entries:
        if _is_ours(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                size += entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
                files += 1
            except FileNotFoundError:
                pass
        else:
            kept.append(entry.name)
    if not kept:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError:
            kept.append("(files made meanwhile)")
    return files, size, kept


def _try_lock(fd: int) -> bool:
    """Takes `fd`'s exclusive lock when it is a regular file whose lock nobody holds."""
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False


def _take_dead_owner_lock(folder: Path, pid: int) -> tuple[int | None, str | None]:
    """Judges whether `folder`'s run is gone. Returns (descriptor holding the folder's owner
    lock or None, why the run is gone) when it is, (None, None) when it lives or cannot be
    judged (then the folder is left alone)."""
    try:
        fd = os.open(folder / OWNER_FILE, _OPEN_OWNER)
    except FileNotFoundError:
        # No owner file: a folder of an old version that died before writing it.
        return (None, f"pid {pid} is gone") if not _process_alive(pid, None) else (None, None)
    except OSError:
        return None, None  # a symlink, someone else's file: not ours to judge
    if not _try_lock(fd):  # its run holds the lock (it lives), or it is no regular file
        os.close(fd)
        return None, None
    try:
        owner = json.loads(os.read(fd, 1 << 16) or b"{}")
        owner = owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        owner = {}
    if owner.get("liveness") == LIVENESS:
        return fd, "nobody holds its owner lock"
    # An old version's folder: it never held the lock, so judge by its pid.
    start_time = owner.get("start_time") if owner.get("pid") == pid else None
    if _process_alive(pid, start_time if isinstance(start_time, int) else None):
        os.close(fd)
        return None, None
    return fd, f"pid {pid} is gone"


def remove_stale_folders(nvme_path: str | os.PathLike) -> list[Path]:
    """Removes the swap folders under ``<nvme_path>/deepspeed_cpp_swap`` that runs on this host
    left behind when they died (see the module doc); logs one line each; returns them. Folders
    not named as ours, of other hosts, or whose owner lock is held are left alone."""
    root = Path(nvme_path) / ROOT_NAME
    host = host_name()
    removed = []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        match = _FOLDER_NAME.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        purpose, _, folder_host = match["prefix"].rpartition("-")
        if folder_host != host or not PURPOSE.fullmatch(purpose):
            continue
        pid = int(match["pid"])
        fd, why = _take_dead_owner_lock(Path(entry.path), pid)
        if why is None:
            continue
        try:  # the lock stays held while the folder goes, so no other sweep judges it meanwhile
            files, size, kept = remove_folder(Path(entry.path))
        finally:
            if fd is not None:
                os.close(fd)
        if kept:
            logger.warning(
                f"swap folder {entry.path} of a run that is gone ({why}) still holds files "
                f"not made by deepspeed_cpp ({', '.join(kept[:5])}); removed {files} swap files "
                f"({size} bytes) and kept the folder"
            )
        else:
            logger.warning(
                f"removed stale swap folder {entry.path}: its run (pid {pid} on this host) is "
                f"gone ({why}); {files} swap files, {size} bytes"
            )
        removed.append(Path(entry.path))
    return removed
