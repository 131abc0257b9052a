"""Storage faults during save_checkpoint: a full disk at each file (a small tmpfs in a private
mount namespace), RLIMIT_FSIZE, a read-only file system and the staging directory removed
mid-save. Each gives a CheckpointSaveError naming the path and the bytes, leaves ``latest`` and
the previous checkpoint loadable, leaves no file under a final name that is not complete and no
``<tag>.partial`` behind. What killed saves leave is cleared by the next save, and a re-saved tag
whose final rename fails is restored (tests/storage_fault_saves.py does the saving, in a
subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT
from disk_folders import mount_namespace_prefix

SCRIPT = REPO_ROOT / "tests" / "storage_fault_saves.py"


def run_phases(*phases, directory, prefix=()) -> dict:
    environment = {"PYTHONPATH": f"{REPO_ROOT}:{REPO_ROOT / 'tests'}"}
    result = subprocess.run(
        [*prefix, sys.executable, str(SCRIPT), *phases, str(directory)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **environment},
    )
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_untouched(outcome: dict) -> None:
    """What every failed save must leave: latest at the previous checkpoint, which loads."""
    assert outcome["latest"] == "good"
    assert outcome["loads"] is True
    assert outcome["temporaries"] == []  # no half-written file under any name
    assert outcome.get("staging_left", False) is False  # a failed save removes <tag>.partial


def test_full_disk_at_each_file_and_read_only_file_system(tmp_path):
    prefix = mount_namespace_prefix(tmp_path)
    if prefix is None:
        pytest.skip("no mount namespace here to make a small file system")
    (tmp_path / "fs").mkdir()
    out = run_phases("enospc", "read_only", directory=tmp_path / "fs", prefix=prefix)
    root = tmp_path / "fs" / "checkpoints"
    for index, outcome in enumerate(out["enospc"]):
        name, error, tag = outcome["file"], outcome["error"], f"fail{index}"
        assert_untouched(outcome)
        assert "No space left on device" in error and "bytes" in error, error
        if name == "latest":
            # Everything of the tag was published; only the pointer could not move.
            assert outcome["published"] is True
            assert f"{root / tag} is complete" in error
            assert f"{root / 'latest'} still names 'good'" in error
            assert f"could not write {root / 'latest'}" in error
            continue
        assert outcome["published"] is False
        assert f"could not write {root / f'{tag}.partial' / name}" in error, error
        assert f"{root / 'latest'} still names 'good'" in error, error
    read_only = out["read_only"]
    assert_untouched(read_only)
    assert "Read-only file system" in read_only["error"]
    assert str(root / "ro.partial") in read_only["error"]
    assert read_only["published"] is False


def test_file_size_limit_staging_removed_and_interrupted_saves(tmp_path):
    out = run_phases("fsize", "removed", "leftovers", "replace_fails", directory=tmp_path)
    root = tmp_path / "checkpoints"
    shard = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    big = out["fsize"]
    assert_untouched(big)
    assert big["published"] is False
    assert "File too large" in big["error"]
    assert f"could not write {root / 'big.partial' / shard}" in big["error"]
    assert f"{big['limit']} bytes of it were written" in big["error"]
    gone = out["removed"]
    assert_untouched(gone)
    assert gone["published"] is False
    assert f"could not write {root / 'gone.partial' / shard}" in gone["error"]
    assert "No such file or directory" in gone["error"]
    assert "could not be created or is gone" in gone["error"]
    cleared = out["leftovers"]
    assert cleared["loads"] is True
    # killed.partial and the stale good.replaced removed; again.replaced renamed back to again;
    # notes.partial, which holds a file no save writes, left alone
    assert cleared["entries"] == [
        "again", "good", "latest", "next", "notes.partial", "zero_to_fp32.py",
    ], cleared["entries"]  # fmt: skip
    assert cleared["again"] == {"epoch": 3}
    failed = out["replace_fails"]
    assert_untouched(failed)
    assert failed["published"] is True and failed["replaced_left"] is False
    assert failed["rep"] == {"epoch": 5}  # the old checkpoint of the tag, back under its name
    assert "Input/output error (injected)" in failed["error"], failed["error"]
    assert f"the previous {root / 'rep'} was restored" in failed["error"], failed["error"]


def test_resave_whose_previous_copy_cannot_be_removed_says_what_was_published(tmp_path):
    prefix = mount_namespace_prefix(tmp_path)
    if prefix is None:
        pytest.skip("no mount namespace here to mount a file system inside a checkpoint")
    (tmp_path / "fs").mkdir()
    out = run_phases("displaced_stays", directory=tmp_path / "fs", prefix=prefix)
    root = tmp_path / "fs" / "checkpoints"
    pin = out["displaced_stays"]
    assert pin["error"] is None and pin["published"] is True  # the save did what it promised
    assert pin["latest"] == "pin"
    assert pin["next"]["error"] is None and pin["next"]["latest"] == "after_pin"
    assert pin["pin"] == {"epoch": 2}  # the new copy of the tag, not the displaced one
    assert pin["replaced_left"] is True
    published = [w for w in pin["warnings"] if w.startswith("deepspeed_cpp: published")]
    assert len(published) == 1, pin["warnings"]
    assert f"published checkpoint {root / 'pin'} (latest -> pin)" in published[0]
    assert f"the previous copy of pin was left at {root / 'pin.replaced'}" in published[0]
    assert "Device or resource busy" in published[0], published[0]
    assert "nothing was published" not in " ".join(pin["warnings"])
    # The next save tries the removal again, says it could not, and saves all the same.
    assert any("could not remove" in w and "pin.replaced" in w for w in pin["warnings"])
