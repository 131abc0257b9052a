"""Swap folders of runs that died: found by name (ours, this host, a process that is gone) and
removed when a new ``SwapFolder`` is made under the same ``nvme_path``."""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

from ....utils.logging import logger
from .swap_header import SUFFIX

ROOT_NAME = "deepspeed_cpp_swap"
OWNER_FILE = "owner"
RUN_ID_HEX = 16  # run_id: 16 random hex digits
PURPOSE = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")
_FOLDER_NAME = re.compile(
    r"(?P<prefix>.+)-pid(?P<pid>[0-9]+)-rank(?P<rank>[0-9]+)-(?P<run_id>[0-9a-f]{"
    + str(RUN_ID_HEX)
    + "})"
)


def host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _process_alive(pid: int, start_time: int | None) -> bool:
    """Whether process `pid` runs (not a zombie) and is the one that started at `start_time`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
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


def remove_stale_folders(nvme_path: str | os.PathLike) -> list[Path]:
    """Removes the swap folders under ``<nvme_path>/deepspeed_cpp_swap`` that runs on this host
    left behind when they died (their process is gone); logs one line each; returns them.
    Folders not named as ours, of other hosts, or of live processes are left alone."""
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
        if _process_alive(pid, _owner_start_time(Path(entry.path), pid)):
            continue
        files, size, kept = remove_folder(Path(entry.path))
        if kept:
            logger.warning(
                f"swap folder {entry.path} of a run that is gone (pid {pid}) still holds files "
                f"not made by deepspeed_cpp ({', '.join(kept[:5])}); removed {files} swap files "
                f"({size} bytes) and kept the folder"
            )
        else:
            logger.warning(
                f"removed stale swap folder {entry.path}: its run (pid {pid} on this host) is "
                f"gone; {files} swap files, {size} bytes"
            )
        removed.append(Path(entry.path))
    return removed


def _owner_start_time(folder: Path, pid: int) -> int | None:
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
        return int(owner["start_time"]) if owner.get("pid") == pid else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
