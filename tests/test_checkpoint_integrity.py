"""Checkpoint integrity: every file's SHA-256 is in checkpoint_meta.json, computed while writing,
and one flipped byte in any file a checkpoint holds makes loading (2 gloo ranks) and zero_to_fp32
fail naming the file, the recorded digest and the digest found."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_training import build_engine, global_batches, params_of, train
from dist_pool import shared_pool

from deepspeed_cpp.runtime.checkpoint import IncompleteCheckpointError
from deepspeed_cpp.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, main

STAGE = 2
FILES = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    "client_state.pt",
    "checkpoint_meta.json",
]


@pytest.fixture
def pool():
    return shared_pool(2)


def save_job(directory: str, seed: int):
    engine = build_engine(seed, dist.get_world_size(), STAGE)
    train(engine, global_batches(seed, 2))
    engine.save_checkpoint(directory, tag="good", client_state={"epoch": 3, "t": torch.arange(5)})
    return params_of(engine)


def load_job(directory: str, seed: int, tags: list[str]):
    """Loads each tag into a fresh engine; the error text, or the loaded client state."""
    outcomes = {}
    for tag in tags:
        engine = build_engine(seed + 1, dist.get_world_size(), STAGE)
        try:
            outcomes[tag] = engine.load_checkpoint(directory, tag=tag)[1]
        except IncompleteCheckpointError as error:
            outcomes[tag] = f"{type(error).__name__}: {error}"
    return outcomes


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def flip_one_byte(path: Path) -> None:
    """Flips one bit of one byte in the middle of a torch file; in the JSON metadata, changes one
    digit of the save time, so the file still parses and only its digest can tell."""
    data = bytearray(path.read_bytes())
    if path.suffix == ".json":
        match = re.search(rb'"saved_at_unix": \d+\.(\d)', data)
        position = match.start(1)
        data[position] = ord("1") if data[position] != ord("1") else ord("2")
    else:
        data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def strip_digests(directory: Path) -> None:
    """What a checkpoint saved before digests existed looks like."""
    meta_path = directory / "checkpoint_meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("metadata_sha256")
    for entry in meta["files"]:
        entry.pop("sha256")
    meta_path.write_text(json.dumps(meta))


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_one_flipped_byte_in_any_file_is_named(pool, tmp_path):
    seed = int(torch.randint(0, 2**30, (1,)))
    saved = pool.run(save_job, str(tmp_path), seed)[0]
    good = tmp_path / "good"
    meta = json.loads((good / "checkpoint_meta.json").read_text())
    recorded = {entry["name"]: entry["sha256"] for entry in meta["files"]}
    assert sorted(recorded) == sorted(FILES[:-1])
    for name, digest in recorded.items():  # hashed while written = the bytes on disk
        assert digest == sha256(good / name), name

    tags = []
    for name in FILES:
        tag = f"flip_{name.split('.')[0]}"
        shutil.copytree(good, tmp_path / tag)
        flip_one_byte(tmp_path / tag / name)
        tags.append(tag)
    shutil.copytree(good, tmp_path / "legacy")
    strip_digests(tmp_path / "legacy")

    handler = Collect()
    logging.getLogger("deepspeed_cpp").addHandler(handler)
    try:
        legacy = get_fp32_state_dict_from_zero_checkpoint(tmp_path / "legacy")
        get_fp32_state_dict_from_zero_checkpoint(tmp_path / "legacy")  # warned once only
    finally:
        logging.getLogger("deepspeed_cpp").removeHandler(handler)
    warnings = [m for m in handler.messages if "no SHA-256 digests" in m]
    assert len(warnings) == 1 and "loaded without an integrity check" in warnings[0]
    for name, value in legacy.items():
        assert torch.equal(value, saved[name].float()), name

    results = pool.run(load_job, str(tmp_path), seed, [*tags, "good", "legacy"])
    for rank, outcomes in enumerate(results):
        for tag in ("good", "legacy"):
            assert outcomes[tag]["epoch"] == 3 and torch.equal(outcomes[tag]["t"], torch.arange(5))
        for name, tag in zip(FILES, tags):
            message = outcomes[tag]
            assert isinstance(message, str), (rank, tag, message)
            assert message.startswith("IncompleteCheckpointError"), message
            path = tmp_path / tag / name
            assert f"{path} (" in message and "is damaged: its SHA-256 is" in message
            if name == "checkpoint_meta.json":
                assert f"records {meta['metadata_sha256']}" in message
            else:
                assert f"its SHA-256 is {sha256(path)}, checkpoint_meta.json records " in message
                assert f"records {recorded[name]}" in message
            if name == f"zero_pp_rank_{1 - rank}_mp_rank_00_optim_states.pt":
                # Only the other rank reads it; this one is told which rank failed and why.
                assert f"failed on 1 rank(s): rank {1 - rank}: IncompleteCheckpointError" in message

    # zero_to_fp32 reads the metadata, the module states and every shard file (not the client
    # state): each damaged one is refused the same way, by the function and by the command.
    for name, tag in zip(FILES, tags):
        if name == "client_state.pt":
            continue
        with pytest.raises(IncompleteCheckpointError, match="is damaged: its SHA-256 is") as info:
            get_fp32_state_dict_from_zero_checkpoint(tmp_path / tag)
        assert str(tmp_path / tag / name) in str(info.value)
        assert main([str(tmp_path / tag), str(tmp_path / f"{tag}.bin")]) == 1
        assert not (tmp_path / f"{tag}.bin").exists()
