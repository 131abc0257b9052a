"""A save folder prepared by someone else (2 gloo ranks, real engines and files): the save lock
is never followed through a symbolic link and leaves no file behind; ``latest``, tags and the
file names a checkpoint lists never lead out of the folder, and symbolic links are followed only
with ``allow_symlinks=True``; files holding objects other than tensors are refused naming the
file, without torch's advice to unpickle them in full; a re-save over a linked tag folder says
what it did. The consolidator (``zero_to_fp32``) is held to the same rules."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_training import build_engine, global_batches, params_of, train
from conftest import REPO_ROOT
from dist_pool import shared_pool

from deepspeed_cpp.runtime.checkpoint import IncompleteCheckpointError, UnsafeCheckpointError
from deepspeed_cpp.runtime.checkpoint.digests import seal_metadata
from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

STAGE = 2
LOCK = ".deepspeed_cpp_save.lock"
MODULE = "mp_rank_00_model_states.pt"
SHARD1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"


@pytest.fixture
def pool():
    return shared_pool(2)


def _outcome(call):
    try:
        return call()
    except Exception as error:  # noqa: BLE001 - the test reads the type and the message
        return f"{type(error).__name__}: {error}"


def save_job(directory: str, seed: int, tags: list[str]):
    """Trains one step, then saves each tag in turn: the error text, or the files in the
    folder after the save."""
    engine = build_engine(seed, dist.get_world_size(), STAGE)
    train(engine, global_batches(seed, 1))
    outcomes = {}
    for tag in tags:
        saved = _outcome(lambda tag=tag: engine.save_checkpoint(directory, tag=tag))
        outcomes[tag] = sorted(os.listdir(directory)) if saved is True else saved
    return outcomes, params_of(engine)


def load_job(directory: str, seed: int, attempts: dict[str, dict]):
    """Loads each attempt's keyword arguments into one engine (a refused load leaves it as it
    was): the error text, or (path, the loaded parameters)."""
    engine = build_engine(seed + 1, dist.get_world_size(), STAGE)
    outcomes = {}
    for key, kwargs in attempts.items():
        outcomes[key] = _outcome(
            lambda kwargs=kwargs: (
                engine.load_checkpoint(directory, **kwargs)[0],
                params_of(engine),
            )
        )
    return outcomes


def _reseal(tag_dir: Path, change=lambda meta: None) -> None:
    """Rewrites the metadata's sizes and digests to match the files (digests detect damage, not
    tampering: an attacker rewrites them too), after ``change(meta)``."""
    meta_path = tag_dir / "checkpoint_meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("metadata_sha256")
    change(meta)
    for entry in meta["files"]:
        path = tag_dir / entry["name"]
        if path.is_file():
            entry["bytes"] = path.stat().st_size
            entry["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    meta_path.write_text(json.dumps(seal_metadata(meta)))


def _consolidate(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepspeed_cpp.utils.zero_to_fp32", *map(str, args)],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip


# --- the save lock ------------------------------------------------------------------------------


def test_save_lock_leaves_no_file_in_the_saved_folder(pool, tmp_path):
    """The Hugging Face integration saves into each checkpoint-N/, which users copy."""
    root = tmp_path / "checkpoint-2"
    seed = int(torch.randint(0, 2**30, (1,)))
    # Rank 0 holds the lock; once its save returns, the folder holds the checkpoints only.
    outcomes, _ = pool.run(save_job, str(root), seed, ["a", "b"])[0]
    script = "zero_to_fp32.py"  # beside latest, as DeepSpeed leaves it
    assert outcomes == {"a": ["a", "latest", script], "b": ["a", "b", "latest", script]}
    assert sorted(os.listdir(root)) == ["a", "b", "latest", script]


def test_save_lock_is_never_followed(pool, tmp_path):
    root = tmp_path / "checkpoints"
    seed = int(torch.randint(0, 2**30, (1,)))
    pool.run(save_job, str(root), seed, ["good"])
    (root / LOCK).unlink(missing_ok=True)  # what an older deepspeed_cpp left
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = {
        "symlink": lambda lock: lock.symlink_to(victim),
        "hard_link": lambda lock: os.link(victim, lock),
        "directory": lambda lock: lock.mkdir(),
        "fifo": lambda lock: os.mkfifo(lock),
    }
    for kind, plant in planted.items():
        plant(root / LOCK)
        for rank, (outcomes, _) in enumerate(pool.run(save_job, str(root), seed, [kind])):
            refused = outcomes[kind]
            assert refused.startswith("CheckpointSaveError"), (kind, rank, refused)
            assert f"the save lock {root / LOCK} " in refused, refused
            expected = {"symlink": "is a symbolic link", "hard_link": "has other names"}
            assert expected.get(kind, "is not a regular file") in refused, refused
        assert victim.read_text() == "precious", kind
        assert not (root / kind).exists() and (root / "latest").read_text() == "good"
        if kind == "directory":
            (root / LOCK).rmdir()
        else:
            (root / LOCK).unlink()
    outcomes, _ = pool.run(save_job, str(root), seed, ["again"])[0]
    assert outcomes["again"] == ["again", "good", "latest", "zero_to_fp32.py"]
    assert victim.read_text() == "precious"


# --- paths on load ------------------------------------------------------------------------------


def test_latest_and_tags_stay_inside_the_save_folder(pool, tmp_path):
    root = tmp_path / "checkpoints"
    seed = int(torch.randint(0, 2**30, (1,)))
    _, saved = pool.run(save_job, str(root), seed, ["good"])[0]
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / "good", elsewhere / "x")
    (root / "linked").symlink_to(elsewhere / "x", target_is_directory=True)
    shutil.copytree(root / "good", root / "escaping_names")
    shutil.copy(root / "good" / MODULE, tmp_path / MODULE)

    def escape(meta):
        next(e for e in meta["files"] if e["name"] == MODULE)["name"] = f"../../{MODULE}"

    _reseal(root / "escaping_names", escape)
    # The module file left out of the list and made a link out of the folder: never read.
    shutil.copytree(root / "good", root / "unlisted")
    (root / "unlisted" / MODULE).unlink()
    (root / "unlisted" / MODULE).symlink_to(tmp_path / MODULE)
    _reseal(root / "unlisted", lambda meta: meta.update(
        files=[e for e in meta["files"] if e["name"] != MODULE]))  # fmt: skip
    attempts = {
        "tag_up": {"tag": "../elsewhere/x"},
        "tag_absolute": {"tag": str(elsewhere / "x")},
        "tag_linked": {"tag": "linked"},
        "tag_linked_allowed": {"tag": "linked", "allow_symlinks": True},
        "escaping_names": {"tag": "escaping_names"},
        "unlisted": {"tag": "unlisted"},
    }
    results = pool.run(load_job, str(root), seed, attempts)
    for latest in ("../elsewhere/x", str(elsewhere / "x")):
        (root / "latest").write_text(latest)
        results.append(pool.run(load_job, str(root), seed, {latest: {}})[0])
    (root / "latest").unlink()
    (tmp_path / "latest_elsewhere").write_text("good")
    (root / "latest").symlink_to(tmp_path / "latest_elsewhere")
    linked_latest = {"latest_linked": {}, "latest_linked_allowed": {"allow_symlinks": True}}
    results.append(pool.run(load_job, str(root), seed, linked_latest)[0])
    outcomes = {key: value for result in results for key, value in result.items()}
    for key in ("tag_up", "tag_absolute"):
        refused = outcomes[key]
        assert refused.startswith("ValueError: checkpoint tag"), refused
        assert repr(attempts[key]["tag"]) in refused and "one directory name" in refused
    for latest in ("../elsewhere/x", str(elsewhere / "x")):
        refused = outcomes[latest]
        assert refused.startswith("UnsafeCheckpointError"), refused
        assert f"{root / 'latest'} names {latest!r}, which is not a checkpoint inside" in refused
    for key, named in (("tag_linked", "linked"), ("latest_linked", "latest")):
        refused = outcomes[key]
        assert refused.startswith("UnsafeCheckpointError"), refused
        assert f"{root / named} (" in refused and "is a symbolic link" in refused
        assert "allow_symlinks=True" in refused
    for key, path in (("tag_linked_allowed", "linked"), ("latest_linked_allowed", "good")):
        loaded_path, params = outcomes[key]
        assert loaded_path == str(root / path)
        assert all(torch.equal(params[name], value) for name, value in saved.items())
    refused = outcomes["escaping_names"]
    assert refused.startswith("UnsafeCheckpointError"), refused
    assert f"lists the file '../../{MODULE}', which is not a file name inside" in refused
    refused = outcomes["unlisted"]
    assert refused.startswith("IncompleteCheckpointError"), refused
    assert f"'{MODULE}' (module states) is not among the files checkpoint_meta.json" in refused

    # The consolidator: the same rules, each refusal one line on stderr and exit status 1.
    (root / "latest").unlink()
    (root / "latest").write_text("../elsewhere/x")
    with pytest.raises(UnsafeCheckpointError, match="which is not a checkpoint inside"):
        get_fp32_state_dict_from_zero_checkpoint(root)
    with pytest.raises(ValueError, match="one directory name"):
        get_fp32_state_dict_from_zero_checkpoint(root, tag="../elsewhere/x")
    with pytest.raises(UnsafeCheckpointError, match="is a symbolic link"):
        get_fp32_state_dict_from_zero_checkpoint(root, tag="linked")
    with pytest.raises(UnsafeCheckpointError, match="which is not a file name inside"):
        get_fp32_state_dict_from_zero_checkpoint(root, tag="escaping_names")
    with pytest.raises(IncompleteCheckpointError, match="is not among the files"):
        get_fp32_state_dict_from_zero_checkpoint(root, tag="unlisted")
    consolidated = get_fp32_state_dict_from_zero_checkpoint(root, tag="linked", allow_symlinks=True)
    assert all(torch.equal(consolidated[n], v.float()) for n, v in saved.items())
    for args in ([], ["--tag", "../elsewhere/x"], ["--tag", "linked"]):
        result = _consolidate(root, tmp_path / "out.bin", *args)
        assert result.returncode == 1, (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert result.stderr.startswith("zero_to_fp32: ") and "Traceback" not in result.stderr
    assert not (tmp_path / "out.bin").exists()
    result = _consolidate(root, tmp_path / "out.bin", "--tag", "linked", "--allow_symlinks")
    assert result.returncode == 0 and (tmp_path / "out.bin").is_file(), result.stderr


# --- errors -------------------------------------------------------------------------------------


class RunsCode:
    """Unpickling it creates the folder ``marker``: what a hostile file would do."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_files_holding_objects_are_refused_without_torchs_advice(pool, tmp_path):
    root = tmp_path / "checkpoints"
    seed = int(torch.randint(0, 2**30, (1,)))
    pool.run(save_job, str(root), seed, ["good"])
    marker = tmp_path / "code_ran"
    for tag, name in (("module", MODULE), ("shard", SHARD1)):
        shutil.copytree(root / "good", root / tag)
        payload = torch.load(root / tag / name, weights_only=True)
        payload["hostile"] = RunsCode(str(marker))
        torch.save(payload, root / tag / name)
        _reseal(root / tag)
    results = pool.run(load_job, str(root), seed, {"module": {"tag": "module"},
                                                   "shard": {"tag": "shard"}})  # fmt: skip
    for rank, outcomes in enumerate(results):
        for tag, name, role in (("module", MODULE, "module states"),
                                ("shard", SHARD1, "shard file")):  # fmt: skip
            message = outcomes[tag]
            if tag == "shard" and rank == 0:  # only rank 1 reads its own shard file
                assert "failed on 1 rank(s): rank 1: UnsafeCheckpointError" in message, message
            else:
                assert message.startswith("UnsafeCheckpointError"), message
            assert f"checkpoint file {root / tag / name} ({role})" in message, message
            assert "this file holds objects that are not tensors" in message
            assert "it was not written by deepspeed_cpp or it was tampered with" in message
            assert "weights_only" not in message and "trusted source" not in message
    assert not marker.exists()
    # zero_to_fp32: one line, no traceback, exit status 1.
    for tag in ("module", "shard"):
        result = _consolidate(root, tmp_path / "out.bin", "--tag", tag)
        assert result.returncode == 1, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
        assert "this file holds objects that are not tensors" in result.stderr
        assert "weights_only" not in result.stderr
    assert not marker.exists() and not (tmp_path / "out.bin").exists()


def test_resave_over_a_linked_tag_folder_publishes_and_keeps_the_link_target(pool, tmp_path):
    root = tmp_path / "checkpoints"
    seed = int(torch.randint(0, 2**30, (1,)))
    pool.run(save_job, str(root), seed, ["good"])
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / "good", elsewhere)
    before = sorted(os.listdir(elsewhere))
    (root / "kept").symlink_to(elsewhere, target_is_directory=True)
    outcomes, _ = pool.run(save_job, str(root), seed + 1, ["kept"])[0]
    assert outcomes["kept"] == ["good", "kept", "latest", "zero_to_fp32.py"], outcomes
    assert not (root / "kept").is_symlink() and (root / "latest").read_text() == "kept"
    assert sorted(os.listdir(elsewhere)) == before  # the link's target is not the save's
