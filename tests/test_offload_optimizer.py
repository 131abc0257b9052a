"""ZeRO-Offload (offload_optimizer to cpu and nvme) and the delayed parameter update, 2 gloo ranks.

Offload moves where the fp32 masters and the optimizer state live, not what is computed: every
run is compared bitwise with the same stage in memory. The delayed parameter update is compared
with a one-process reference that applies each update one step late (zero3_helpers.reference).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from zero3_helpers import (
    config,
    make_model,
    max_relative_difference,
    named_state,
    reference,
    tolerance,
    train,
)

SEED, STEPS = 11, 4


def _config(stage, dtype, offload, *, gas=2, clip=0.5, sub_group_size=700):
    result = config(dtype, gas, clip, threshold=50)
    result["zero_optimization"].update(stage=stage, sub_group_size=sub_group_size)
    if offload is not None:
        result["zero_optimization"]["offload_optimizer"] = offload
    return result


def _nvme(folder, **extra):
    return {"device": "nvme", "nvme_path": folder, "pipeline_read": True,
            "pipeline_write": True, "buffer_count": 3, **extra}  # fmt: skip


def _shared_folder() -> str:
    """One folder for both ranks (rank 0 makes it); each rank's swap files go below it."""
    names = [tempfile.mkdtemp(prefix="ds_offload_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def _train_job(stage, dtype, device, steps=STEPS):
    """Trains in memory, then with the optimizer offloaded; returns both parameter sets and
    what the offloaded engine kept in host memory and on disk."""
    import deepspeed_cpp

    folder = _shared_folder()
    offload = {"device": "cpu"} if device == "cpu" else _nvme(folder)
    results, extra = [], {}
    for part in (None, offload):
        engine, *_ = deepspeed_cpp.initialize(
            model=make_model(SEED), config=_config(stage, dtype, part)
        )
        results.append(train(engine, SEED, steps))
        if part is not None:
            home = engine.optimizer.home
            extra = {"kind": home.kind, "sub_groups": len(home.sub_groups),
                     "host_bytes": engine.optimizer.state_bytes(),
                     "files": sorted(os.listdir(folder))}  # fmt: skip
        engine.destroy()
    extra["left_after_destroy"] = [f for _, _, files in os.walk(folder) for f in files]
    return results, extra


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_is_bitwise_the_same_stage_in_memory(pool2, stage, device, dtype):
    for (in_memory, offloaded), extra in pool2.run(_train_job, stage, dtype, device):
        assert extra["kind"] == device
        assert extra["sub_groups"] > 2  # several sub-groups: the swapping order is exercised
        for name, value in in_memory.items():
            assert torch.equal(offloaded[name], value), (name, stage, device, dtype)
        assert extra["left_after_destroy"] == []  # destroy() removed the swap files


def _delayed_job(stage, dtype, warmup, steps):
    import deepspeed_cpp

    offload = {"device": "cpu", "delayed_param_update": True,
               "delayed_param_update_warmup_steps": warmup}  # fmt: skip
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(SEED), config=_config(stage, dtype, offload, clip=1.0)
    )
    result = train(engine, SEED, steps)
    engine.destroy()
    return result


@pytest.mark.parametrize("stage, dtype", [(2, "fp32"), (3, "fp32"), (1, "bf16")])
def test_delayed_update_equals_applying_each_update_one_step_late(pool2, stage, dtype):
    warmup, steps = 2, 6
    expected = named_state(
        reference(
            SEED,
            steps,
            2,
            2,
            1.0,
            getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype]),
            delayed_after=warmup,
        )  # fmt: skip
    )
    not_delayed = named_state(reference(SEED, steps, 2, 2, 1.0, delayed_after=None))
    for ours in pool2.run(_delayed_job, stage, dtype, warmup, steps):
        assert max_relative_difference(ours, expected) <= tolerance(dtype)
    # The reference's staleness is visible at this tolerance (the test could fail).
    assert max_relative_difference(expected, not_delayed) > 100 * tolerance("fp32")


def _warmup_only_job(stage):
    import deepspeed_cpp

    results = []
    for part in (None, {"device": "cpu", "delayed_param_update": True,
                        "delayed_param_update_warmup_steps": STEPS}):  # fmt: skip
        engine, *_ = deepspeed_cpp.initialize(
            model=make_model(SEED), config=_config(stage, "fp32", part)
        )
        results.append(train(engine, SEED, STEPS))
        engine.destroy()
    return results


def test_warmup_steps_of_the_delayed_update_are_ordinary_steps(pool2):
    for ordinary, warmup in pool2.run(_warmup_only_job, 2):
        for name, value in ordinary.items():
            assert torch.equal(warmup[name], value), name


def _error_of(config_dict):
    import deepspeed_cpp

    try:
        deepspeed_cpp.initialize(model=make_model(SEED), config=config_dict)
    except (ValueError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def _errors_job(missing):
    nvme = {"device": "nvme", "nvme_path": missing}
    return [
        _error_of(_config(0, "fp32", {"device": "cpu"})),
        _error_of(_config(2, "fp32", {**nvme, "delayed_param_update": True})),
        _error_of(_config(2, "fp32", nvme)),
    ]


def test_bad_offload_settings_are_named(pool2):
    missing = os.path.join(tempfile.gettempdir(), "ds_offload_no_such_dir", "nvme")
    for stage0, delayed_nvme, no_folder in pool2.run(_errors_job, missing):
        assert "offload_optimizer.device = 'cpu' needs ZeRO stage 1, 2 or 3" in stage0
        assert 'delayed_param_update = true needs offload_optimizer.device "cpu"' in delayed_nvme
        assert 'got device "nvme"' in delayed_nvme
        assert missing in no_folder and "ENOENT" in no_folder
