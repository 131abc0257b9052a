"""The comet monitor (issue 30) on 2 gloo ranks with ZeRO-3 and fp16, offline (``online: false``:
no account, no network): rank 0 alone starts a Comet ``OfflineExperiment``, whose archive (a zip
that ``comet upload`` would send) holds the engine's losses, learning rates and loss scales at
DeepSpeed's sample steps, thinned by ``samples_log_interval`` as DeepSpeed does, under the
config's project and experiment name."""

from __future__ import annotations

import json
import os
import zipfile

import pytest
from test_checkpoint import start_pool
from test_monitor import GAS, STEPS, _assert_points, _train_with_monitors

# Set in the worker, where comet_ml reads them: the archive under the test's folder, and none of
# the environment, git, console or system-metrics logging an offline test does not look at.
_QUIET = {
    "COMET_AUTO_LOG_ENV_DETAILS": "false",
    "COMET_AUTO_LOG_GIT_METADATA": "false",
    "COMET_AUTO_LOG_GIT_PATCH": "false",
    "COMET_AUTO_LOG_OUTPUT_LOGGER": "false",
    "COMET_AUTO_LOG_ENV_CPU": "false",
    "COMET_AUTO_LOG_ENV_HOST": "false",
    "COMET_AUTO_LOG_ENV_GPU": "false",
    "COMET_AUTO_LOG_ENV_NETWORK": "false",
    "COMET_AUTO_LOG_ENV_DISK": "false",
    "COMET_DISABLE_AUTO_LOGGING": "1",
}


@pytest.fixture(scope="module")
def pool2():
    pool = start_pool(2)
    yield pool
    pool.close()


def _train_offline(root: str, interval: int):
    before = dict(os.environ)
    os.environ.update(_QUIET, COMET_OFFLINE_DIRECTORY=os.path.join(root, "comet"))
    section = {
        "enabled": True,
        "online": False,
        "project": "ds_cpp_test",
        "experiment_name": "zero3_fp16",
        "samples_log_interval": interval,
    }
    try:
        return _train_with_monitors(root, 3, True, monitors={"comet": section})
    finally:
        os.environ.clear()
        os.environ.update(before)


def _read_archive(path) -> tuple[dict, dict, dict[str, list[tuple[int, float]]]]:
    """The experiment record, its "other" values (the name) and, per metric, its (step, value)
    points in logged order."""
    with zipfile.ZipFile(path) as archive:
        experiment = json.loads(archive.read("experiment.json"))
        lines = archive.read("messages.json").decode().splitlines()
    curves: dict[str, list[tuple[int, float]]] = {}
    others = {}
    for line in lines:
        message = json.loads(line)
        if message["type"] == "log_other":
            others[message["payload"]["key"]] = message["payload"]["value"]
        if message["type"] == "metric_msg":
            metric = message["payload"]["metric"]
            points = curves.setdefault(metric["metricName"], [])
            points.append((metric["step"], float(metric["metricValue"])))
    return experiment, others, curves


def test_comet_offline_archive_holds_the_engine_curves(pool2, tmp_path):
    pytest.importorskip("comet_ml")
    batch = 3 * GAS * 2  # MICRO x GAS x world size
    results = pool2.run(_train_offline, str(tmp_path), 2 * batch)
    losses, lrs, scales, train_batch = results[0]
    assert train_batch == batch
    archives = list((tmp_path / "comet").glob("*.zip"))
    assert len(archives) == 1, archives  # rank 0's only
    experiment, others, curves = _read_archive(archives[0])
    assert experiment["project_name"] == "ds_cpp_test"
    assert others["Name"] == "zero3_fp16" and others["offline_experiment"] is True
    engine_curves = {name: points for name, points in curves.items() if name.startswith("Train/")}
    assert set(engine_curves) == {
        "Train/Samples/train_loss",
        "Train/Samples/lr",
        "Train/Samples/loss_scale",
    }
    # DeepSpeed's steps (the loss at the samples seen before the step, lr and loss scale at
    # those after it), each name logged only once samples_log_interval (two steps' samples)
    # have passed since its last point: every other step, from the first.
    assert len(losses) == STEPS and GAS > 1 and STEPS % 2 == 0
    loss_points = [(batch * i, loss) for i, loss in enumerate(losses)][::2]
    lr_points = [(batch * (i + 1), lr) for i, lr in enumerate(lrs)][::2]
    scale_points = [(batch * (i + 1), scale) for i, scale in enumerate(scales)][::2]
    _assert_points(engine_curves["Train/Samples/train_loss"], loss_points, rel=1e-6)
    _assert_points(engine_curves["Train/Samples/lr"], lr_points, rel=1e-12)
    _assert_points(engine_curves["Train/Samples/loss_scale"], scale_points, rel=0)
