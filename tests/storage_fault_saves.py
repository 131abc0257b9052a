"""Saves checkpoints while the storage fails under them; run as a subprocess by
tests/test_checkpoint_storage_faults.py (in a private mount namespace for the tmpfs phases).

``python storage_fault_saves.py PHASE... DIRECTORY`` prints one JSON object: per phase, the error
each failed save raised, what ``latest`` names afterwards, the files left behind, and whether
the previous checkpoint still loads with the weights it saved. One gloo process, a real engine.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from checkpoint_training import build_engine, global_batches, params_of, train

from deepspeed_cpp.runtime.checkpoint import CheckpointSaveError, saver

ORDER = [  # what rank 0 of a world of one writes, in order
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "mp_rank_00_model_states.pt",
    "client_state.pt",
    "checkpoint_meta.json",
    "latest",
]


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _attempt(engine, root: Path, tag: str) -> dict:
    try:
        engine.save_checkpoint(root, tag=tag, client_state={"epoch": 2})
        error = None
    except CheckpointSaveError as caught:
        error = str(caught)
    return {
        "error": error,
        "latest": (root / "latest").read_text(),
        "published": (root / tag).exists(),
        "staging_left": (root / f"{tag}.partial").exists(),
        "temporaries": [name for name in _leftovers(root) if ".tmp-" in name],
    }


def _client_state_of(root: Path, tag: str, seed: int):
    """The client state that ``root/tag`` loads with (a fresh engine, all files checked)."""
    return build_engine(seed + 1, 1, 2).load_checkpoint(root, tag=tag)[1]


def _previous_loads(root: Path, good: dict, seed: int) -> bool:
    fresh = build_engine(seed + 1, 1, 2)
    path, client_state = fresh.load_checkpoint(root)
    same = all(torch.equal(value, params_of(fresh)[name]) for name, value in good.items())
    return path == str(root / "good") and client_state == {"epoch": 1} and same


def _fill_to(folder: Path, free_blocks: int) -> Path:
    """A filler file leaving ``free_blocks`` blocks free on ``folder``'s file system."""
    stats = os.statvfs(folder)
    filler = folder / "filler"
    size = (stats.f_bavail - free_blocks) * stats.f_frsize
    with open(filler, "wb") as handle:
        os.posix_fallocate(handle.fileno(), 0, size)
    return filler


def enospc(engine, root: Path, good: dict, seed: int) -> list[dict]:
    """A full disk at each file in turn: room for the files before it and half of it."""
    engine.save_checkpoint(root, tag="probe", client_state={"epoch": 2})
    meta = json.loads((root / "probe" / "checkpoint_meta.json").read_text())
    sizes = {entry["name"]: entry["bytes"] for entry in meta["files"]}
    sizes["checkpoint_meta.json"] = (root / "probe" / "checkpoint_meta.json").stat().st_size
    sizes["latest"] = len("fail0")
    shutil.rmtree(root / "probe")
    (root / "latest").write_text("good")
    block = os.statvfs(root).f_frsize
    blocks = [math.ceil(sizes[name] / block) for name in ORDER]
    results = []
    for index, name in enumerate(ORDER):
        # One block more: the save lock's file, which exists only while a save runs.
        filler = _fill_to(root.parent, sum(blocks[:index]) + blocks[index] // 2 + 1)
        outcome = _attempt(engine, root, f"fail{index}")
        filler.unlink()
        outcome["file"] = name
        outcome["loads"] = _previous_loads(root, good, seed)
        results.append(outcome)
        for leftover in (root / f"fail{index}.partial", root / f"fail{index}"):
            shutil.rmtree(leftover, ignore_errors=True)
        (root / "latest").write_text("good")
    return results


def read_only(engine, root: Path, good: dict, seed: int) -> dict:
    subprocess.run(["mount", "-o", "remount,ro", str(root.parent)], check=True)
    outcome = _attempt(engine, root, "ro")
    outcome["loads"] = _previous_loads(root, good, seed)
    return outcome


def file_size_limit(engine, root: Path, good: dict, seed: int) -> dict:
    shard = root / "good" / ORDER[0]
    limit = shard.stat().st_size // 2
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        outcome = _attempt(engine, root, "big")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    outcome["limit"] = limit
    outcome["loads"] = _previous_loads(root, good, seed)
    return outcome


def directory_removed(engine, root: Path, good: dict, seed: int) -> dict:
    saver.before_rank_files = lambda staging, rank: shutil.rmtree(staging)
    try:
        outcome = _attempt(engine, root, "gone")
    finally:
        saver.before_rank_files = None
    outcome["loads"] = _previous_loads(root, good, seed)
    return outcome


def leftovers_of_killed_saves(engine, root: Path, good: dict, seed: int) -> dict:
    """What killed saves leave, cleared by the next save: a staging directory, a re-saved tag
    stopped between its two renames (only ``<tag>.replaced`` left) and a stale ``.replaced`` copy
    beside its complete tag. A folder that only ends like a staging one is left alone."""
    engine.save_checkpoint(root, tag="again", client_state={"epoch": 3}, save_latest=False)
    os.replace(root / "again", root / "again.replaced")
    shutil.copytree(root / "good", root / "good.replaced")
    (root / "killed.partial").mkdir()
    (root / "killed.partial" / ORDER[0]).write_bytes(b"half a shard")
    (root / "notes.partial").mkdir()  # not a save's: other files in it, never removed
    (root / "notes.partial" / "notes.txt").write_text("someone's notes")
    engine.save_checkpoint(root, tag="next", client_state={"epoch": 4}, save_latest=False)
    return {
        "entries": sorted(p.name for p in root.iterdir() if not p.name.startswith(".")),
        "again": _client_state_of(root, "again", seed),
        "loads": _previous_loads(root, good, seed),
    }


def replace_fails(engine, root: Path, good: dict, seed: int) -> dict:
    """Re-saving a tag whose final rename fails: the old checkpoint is renamed back."""
    engine.save_checkpoint(root, tag="rep", client_state={"epoch": 5}, save_latest=False)
    real_replace = os.replace

    def failing_replace(source, target):
        if str(source).endswith(".partial"):
            raise OSError(5, "Input/output error (injected)")
        real_replace(source, target)

    os.replace = failing_replace
    try:
        outcome = _attempt(engine, root, "rep")
    finally:
        os.replace = real_replace
    outcome["replaced_left"] = (root / "rep.replaced").exists()
    outcome["rep"] = _client_state_of(root, "rep", seed)
    outcome["loads"] = _previous_loads(root, good, seed)
    return outcome


def displaced_copy_stays(engine, root: Path, good: dict, seed: int) -> dict:
    """Re-saving a tag whose previous copy cannot be removed (a file system is mounted inside
    it): the new copy is published and ``latest`` names it; a warning says where the old copy
    was left and why; later saves go on."""
    engine.save_checkpoint(root, tag="pin", client_state={"epoch": 6}, save_latest=False)
    pinned = root / "pin" / "pinned"
    pinned.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(pinned)], check=True)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("deepspeed_cpp").addHandler(handler)
    try:
        outcome = _attempt(engine, root, "pin")
        outcome["pin"] = _client_state_of(root, "pin", seed)
        outcome["replaced_left"] = (root / "pin.replaced").exists()
        outcome["next"] = _attempt(engine, root, "after_pin")
    finally:
        logging.getLogger("deepspeed_cpp").removeHandler(handler)
        subprocess.run(["umount", str(root / "pin.replaced" / "pinned")], check=False)
    outcome["warnings"] = warnings
    return outcome


PHASES = {
    "leftovers": leftovers_of_killed_saves,
    "replace_fails": replace_fails,
    "enospc": enospc,
    "read_only": read_only,
    "fsize": file_size_limit,
    "removed": directory_removed,
    "displaced_stays": displaced_copy_stays,
}


def main() -> None:
    *phases, directory = sys.argv[1:]
    base = Path(directory)
    if {"enospc", "read_only", "displaced_stays"} & set(phases):
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(base)], check=True)
    root = base / "checkpoints"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seed = int(torch.randint(0, 2**30, (1,)))
    engine = build_engine(seed, 1, 2)
    train(engine, global_batches(seed, 1))
    engine.save_checkpoint(root, tag="good", client_state={"epoch": 1})
    good = params_of(engine)
    train(engine, global_batches(seed + 2, 1))  # the failed saves hold other weights
    print(json.dumps({phase: PHASES[phase](engine, root, good, seed) for phase in phases}))


if __name__ == "__main__":
    main()
