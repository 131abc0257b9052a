"""The wandb monitor (issue 30) on 2 gloo ranks with ZeRO-2 and ``WANDB_MODE=offline`` (no
account, no network): rank 0 alone starts a run, and its offline run file holds the engine's
losses and learning rates at DeepSpeed's sample steps, and the config's project and group."""

from __future__ import annotations

import os

import pytest
from monitor_training import GAS, STEPS, assert_points, train_with_monitors
from wandb_run_file import history, run_record, wait_until_finished


def _train_offline(root: str):
    # Offline, under root, quiet; set in the worker, where wandb.init reads them.
    os.environ.update(WANDB_MODE="offline", WANDB_DIR=root, WANDB_SILENT="true")
    section = {"enabled": True, "project": "ds_cpp_test", "group": "zero2"}
    return train_with_monitors(root, 2, False, monitors={"wandb": section})


def test_wandb_offline_run_holds_the_engine_curves(pool2, tmp_path):
    pytest.importorskip("wandb")
    results = pool2.run(_train_offline, str(tmp_path))
    losses, lrs, _, batch = results[0]
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs  # rank 0's only
    wait_until_finished(runs[0])
    run = run_record(runs[0])
    assert (run.project, run.run_group) == ("ds_cpp_test", "zero2")
    curves = history(runs[0])
    assert set(curves) == {"Train/Samples/train_loss", "Train/Samples/lr"}
    assert len(losses) == STEPS and GAS > 1  # the loss is the mean of GAS micro-steps
    # DeepSpeed's steps: the loss at the samples seen before the step, the lr at those after it.
    loss_points = [(batch * i, loss) for i, loss in enumerate(losses)]
    lr_points = [(batch * (i + 1), lr) for i, lr in enumerate(lrs)]
    assert_points(curves["Train/Samples/train_loss"], loss_points, rel=1e-6)
    assert_points(curves["Train/Samples/lr"], lr_points, rel=1e-12)
