"""Two trainings and one save_dir: the second one's save is refused while the first saves (a
lock, named in the error), and a load during the first's save reads the last complete
checkpoint. Two independent gloo worlds of one process each, real engines."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from checkpoint_training import build_engine, global_batches, params_of, train
from dist_pool import shared_pool, start_pool


@pytest.fixture(scope="module")
def two_worlds():
    # The session's one-rank pool and a second, independent world of its own.
    second = start_pool(1)
    yield shared_pool(1), second
    second.close()


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + 120
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} never appeared")
        time.sleep(0.01)


def first_training(directory: str, seed: int):
    """Saves 'first', then pauses inside the save of 'second' until told to go on."""
    from deepspeed_cpp.runtime.checkpoint import saver

    engine = build_engine(seed, 1, 2)
    train(engine, global_batches(seed, 1))
    engine.save_checkpoint(directory, tag="first")
    first = params_of(engine)
    train(engine, global_batches(seed + 1, 1))

    def pause(staging, rank):
        (Path(directory).parent / "paused").touch()
        _wait_for(Path(directory).parent / "go_on", "the second training")

    saver.before_rank_files = pause
    try:
        engine.save_checkpoint(directory, tag="second")
    finally:
        saver.before_rank_files = None
    return os.getpid(), first, params_of(engine)


def second_training(directory: str, seed: int):
    """While the first training is paused mid-save: tries to save, then loads."""
    from deepspeed_cpp.runtime.checkpoint import CheckpointSaveError

    root = Path(directory)
    _wait_for(root.parent / "paused", "the first training")
    engine = build_engine(seed + 7, 1, 2)
    train(engine, global_batches(seed + 7, 1))
    try:
        engine.save_checkpoint(directory, tag="intruder")
        refused = "saved"
    except CheckpointSaveError as error:
        refused = str(error)
    leftovers = sorted(p.name for p in root.iterdir())
    path, _ = engine.load_checkpoint(directory)  # the first training's save is in progress
    loaded = params_of(engine)
    (root.parent / "go_on").touch()
    return refused, leftovers, path, loaded


def save_after_job(directory: str, seed: int):
    engine = build_engine(seed, 1, 2)
    return engine.save_checkpoint(directory, tag="after")


def test_second_training_is_refused_and_a_load_reads_the_complete_checkpoint(two_worlds, tmp_path):
    first_world, second_world = two_worlds
    directory = str(tmp_path / "checkpoints")
    seed = int(torch.randint(0, 2**30, (1,)))
    results = {}
    runner = threading.Thread(
        target=lambda: results.update(first=first_world.run(first_training, directory, seed)[0])
    )
    runner.start()
    try:
        refused, leftovers, path, loaded = second_world.run(second_training, directory, seed)[0]
    finally:
        (tmp_path / "go_on").touch()  # never leave the first training waiting
        runner.join(timeout=300)
    pid, first, second = results["first"]
    assert f"another training is saving into {directory} (pid {pid} on " in refused
    assert ".deepspeed_cpp_save.lock" in refused and "give this one its own" in refused
    assert "intruder.partial" not in leftovers and "second.partial" in leftovers
    assert path == str(tmp_path / "checkpoints" / "first")  # the complete one, not 'second'
    assert all(torch.equal(loaded[name], value) for name, value in first.items())
    assert (tmp_path / "checkpoints" / "latest").read_text() == "second"
    assert not (tmp_path / "checkpoints" / "intruder").exists()
    # The lock went with the first training's save: the folder takes saves again.
    assert second_world.run(save_after_job, directory, seed) == [True]
    assert (tmp_path / "checkpoints" / "latest").read_text() == "after"
