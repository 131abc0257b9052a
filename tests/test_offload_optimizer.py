"""ZeRO-Offload (offload_optimizer to cpu and nvme) and the delayed parameter update, 2 gloo ranks.

Offload moves where the fp32 masters and the optimizer state live, not what is computed: every
run is compared bitwise with the same stage in memory. The delayed parameter update is compared
with a one-process reference that applies each update one step late (zero3_helpers.reference).
"""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
import torch.distributed as dist
from offload_helpers import SEED, nvme_offload, offload_config, run_steps
from zero3_helpers import (
    full_params,
    make_model,
    max_relative_difference,
    named_state,
    reference,
    tolerance,
    train,
)

STEPS = 4


def _shared_folder(parent) -> str:
    """A new folder under ``parent`` (the test's tmp_path) for both ranks (rank 0 makes it);
    each rank's swap files go below it."""
    names = [tempfile.mkdtemp(dir=parent) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def _train_job(parent, stage, dtype, device, steps=STEPS, ratio=1.0):
    """Trains in memory, then with the optimizer offloaded; returns both parameter sets and
    what the offloaded engine kept in host memory and on disk."""
    import deepspeed_cpp

    folder = _shared_folder(parent)
    offload = {"device": "cpu"} if device == "cpu" else nvme_offload(folder)
    offload["ratio"] = ratio
    results, extra = [], {}
    for part in (None, offload):
        engine, *_ = deepspeed_cpp.initialize(
            model=make_model(SEED), config=offload_config(stage, dtype, part)
        )
        results.append(train(engine, SEED, steps))
        if part is not None:
            home = engine.optimizer.home
            extra = {"kind": home.kind, "sub_groups": len(home.sub_groups),
                     "on_device": len(getattr(home, "on_device", ())),
                     "buckets": len(engine.optimizer.shard_grads),
                     "host_bytes": engine.optimizer.state_bytes(),
                     "files": sorted(os.listdir(folder))}  # fmt: skip
        engine.destroy()
    dist.barrier()  # both ranks' engines are destroyed (the folder is shared)
    extra["left_after_destroy"] = [f for _, _, files in os.walk(folder) for f in files]
    return results, extra


# stage x device x dtype pruned from 12 runs to 6: every stage on both devices, each stage and
# each device with both dtypes (test_partial_offload_... and test_step_during_backward_... run
# further combinations).
@pytest.mark.parametrize(
    "stage, device, dtype",
    [(1, "cpu", "fp32"), (1, "nvme", "bf16"), (2, "cpu", "bf16"), (2, "nvme", "fp32"),
     (3, "cpu", "fp32"), (3, "nvme", "bf16")],
)  # fmt: skip
def test_offload_is_bitwise_the_same_stage_in_memory(pool2, tmp_path, stage, device, dtype):
    for (in_memory, offloaded), extra in pool2.run(_train_job, tmp_path, stage, dtype, device):
        assert extra["kind"] == device
        assert extra["sub_groups"] > 2  # several sub-groups: the swapping order is exercised
        for name, value in in_memory.items():
            assert torch.equal(offloaded[name], value), (name, stage, device, dtype)
        assert extra["left_after_destroy"] == []  # destroy() removed the swap files


@pytest.mark.parametrize("stage, device", [(2, "cpu"), (3, "nvme"), (1, "nvme")])
def test_partial_offload_is_bitwise_the_same_stage_in_memory(pool2, tmp_path, stage, device):
    runs = pool2.run(_train_job, tmp_path, stage, "bf16", device, STEPS, 0.4)
    for (in_memory, offloaded), extra in runs:
        # Some buckets stepped on the device, the first ones (40% of the elements) offloaded.
        assert 0 < extra["on_device"] < extra["buckets"], extra
        for name, value in in_memory.items():
            assert torch.equal(offloaded[name], value), (name, stage, device)


def _delayed_job(stage, dtype, warmup, steps):
    import deepspeed_cpp

    offload = {"device": "cpu", "delayed_param_update": True,
               "delayed_param_update_warmup_steps": warmup}  # fmt: skip
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(SEED), config=offload_config(stage, dtype, offload, clip=1.0)
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
            model=make_model(SEED), config=offload_config(stage, "fp32", part)
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
        _error_of(offload_config(0, "fp32", {"device": "cpu"})),
        _error_of(offload_config(2, "fp32", {**nvme, "delayed_param_update": True})),
        _error_of(offload_config(2, "fp32", nvme)),
    ]


def test_bad_offload_settings_are_named(pool2):
    missing = os.path.join(tempfile.gettempdir(), "ds_offload_no_such_dir", "nvme")
    for stage0, delayed_nvme, no_folder in pool2.run(_errors_job, missing):
        assert "offload_optimizer.device = 'cpu' needs ZeRO stage 1, 2 or 3" in stage0
        assert 'delayed_param_update = true needs offload_optimizer.device "cpu"' in delayed_nvme
        assert 'got device "nvme"' in delayed_nvme
        assert missing in no_folder and "ENOENT" in no_folder


# --- checkpoints and host memory ------------------------------------------------------------


def _checkpoint_job(parent, stage, save_with, load_with):
    """Six steps uninterrupted in memory vs three steps with ``save_with`` offload, a checkpoint,
    and three more in a new engine with ``load_with`` offload (None: in memory)."""
    from zero3_helpers import full_params, global_batches

    import deepspeed_cpp

    rank, folder = dist.get_rank(), _shared_folder(parent)
    batches = global_batches(SEED, 6, 2, dist.get_world_size())

    def engine_with(kind):
        cfg = offload_config(stage, "fp32", None)
        if kind == "cpu":
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        elif kind in ("nvme", "infinity"):
            cfg["zero_optimization"]["offload_optimizer"] = nvme_offload(folder)
        if kind == "infinity":  # parameters on NVMe too
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": folder}
        engine, *_ = deepspeed_cpp.initialize(model=make_model(SEED), config=cfg)
        return engine

    engine = engine_with(None)
    run_steps(engine, batches, rank)
    uninterrupted = full_params(engine)
    engine.destroy()

    engine = engine_with(save_with)
    run_steps(engine, batches[:3], rank)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), tag="step3")
    engine.destroy()
    engine = engine_with(load_with)
    engine.load_checkpoint(os.path.join(folder, "ckpt"), tag="step3")
    run_steps(engine, batches[3:], rank)
    resumed = full_params(engine)
    engine.destroy()
    return uninterrupted, resumed


@pytest.mark.parametrize(
    "stage, save_with, load_with",
    [
        (2, "nvme", None),
        (2, None, "nvme"),
        (3, "nvme", "nvme"),
        (1, "cpu", "nvme"),
        (3, "infinity", None),
        (3, "cpu", "infinity"),
    ],  # fmt: skip
)
def test_checkpoints_move_between_offloaded_and_in_memory_runs(
    pool2, tmp_path, stage, save_with, load_with
):
    for uninterrupted, resumed in pool2.run(_checkpoint_job, tmp_path, stage, save_with, load_with):
        for name, value in uninterrupted.items():
            assert torch.equal(resumed[name], value), name


def _budget_job(parent):
    """A model whose optimizer state is several times the NVMe home's host buffers, trained
    with it and in memory."""
    import deepspeed_cpp

    folder = _shared_folder(parent)
    results, figures = [], None
    for offload in (nvme_offload(folder, buffer_count=2), None):
        torch.manual_seed(5)
        model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(16)])
        zero = {"stage": 2, "reduce_bucket_size": 20_000, "sub_group_size": 10_000}
        if offload is not None:
            zero["offload_optimizer"] = offload
        cfg = {"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 4,
               "zero_optimization": zero,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
        engine, *_ = deepspeed_cpp.initialize(model=model, config=cfg)
        generator = torch.Generator().manual_seed(dist.get_rank())
        for _ in range(3):
            loss = engine(torch.randn(4, 128, generator=generator)).square().mean()
            engine.backward(loss)
            engine.step()
        if offload is not None:
            home = engine.optimizer.home
            owned = sum(g.numel() for g in engine.optimizer.shard_grads)
            state_bytes = owned * 4 * 3  # fp32 masters, exp_avg, exp_avg_sq
            figures = (state_bytes, home.host_bytes(), home.disk_bytes(), len(home.sub_groups))
        results.append({n: p.detach().clone() for n, p in model.named_parameters()})
        engine.destroy()
    return figures, results


def test_nvme_host_memory_is_bounded_by_the_buffers_not_the_model(pool2, tmp_path):
    for figures, (offloaded, in_memory) in pool2.run(_budget_job, tmp_path):
        state_bytes, host_bytes, disk_bytes, sub_groups = figures
        assert sub_groups >= 12
        assert (
            4 * host_bytes <= state_bytes
        )  # the state is 4x the host memory it is swapped through
        assert disk_bytes >= state_bytes  # all of it lives in the swap files
        for name, value in in_memory.items():
            assert torch.equal(offloaded[name], value), name


# --- ZeRO-Infinity: parameters offloaded too (stage 3) ---------------------------------------


def _param_offload_job(parent, dtype, device):
    import deepspeed_cpp

    folder = _shared_folder(parent)
    if device == "cpu":
        parts = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    else:
        parts = {"offload_optimizer": nvme_offload(folder),
                 "offload_param": {"device": "nvme", "nvme_path": folder, "buffer_count": 3,
                                   "buffer_size": 4096}}  # fmt: skip
    results, figures, reads = [], {}, []

    def count_reads(engine, step):
        home = engine.optimizer.param_home
        if step in (0, STEPS - 1) and home.kind == "nvme":
            reads.append((home.read_ahead_hits, home.reads_on_demand))

    for extra in ({}, parts):
        cfg = offload_config(3, dtype, None)
        cfg["zero_optimization"].update(extra)
        engine, *_ = deepspeed_cpp.initialize(model=make_model(SEED), config=cfg)
        results.append(train(engine, SEED, STEPS, between=count_reads if extra else None))
        if extra:
            home = engine.optimizer.param_home
            figures = {"kind": home.kind, "reads": reads,
                       "shards": [str(p.ds_tensor.device) for p in engine.module.parameters()
                                  if not p.ds_persist]}  # fmt: skip
        engine.destroy()
    return results, figures


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_parameter_offload_is_bitwise_stage3_in_memory(pool2, tmp_path, device, dtype):
    for (in_memory, offloaded), figures in pool2.run(_param_offload_job, tmp_path, dtype, device):
        assert figures["kind"] == device
        # Between uses no shard is on the device: on the host, or only a size on NVMe.
        assert set(figures["shards"]) == {"cpu" if device == "cpu" else "meta"}
        if device == "nvme":  # after the first step, every shard was read ahead of its use
            (hits_first, on_demand_first), (hits_last, on_demand_last) = figures["reads"]
            assert on_demand_first > 0 and on_demand_last == on_demand_first, figures
            assert hits_last - hits_first >= 2 * (STEPS - 1), figures
        for name, value in in_memory.items():
            assert torch.equal(offloaded[name], value), (name, device, dtype)


def _vanished_folder_job(parent):
    """The NVMe folder disappears mid-training: the next step names it; the last checkpoint
    loads into a new engine and training goes on."""
    import shutil

    from zero3_helpers import full_params, global_batches

    import deepspeed_cpp
    from deepspeed_cpp.runtime.zero.offload import SwapFileError

    rank, folder = dist.get_rank(), _shared_folder(parent)
    nvme = os.path.join(folder, "nvme")
    os.makedirs(nvme, exist_ok=True)
    batches = global_batches(SEED, 3, 2, dist.get_world_size())
    offload = {"device": "nvme", "nvme_path": nvme}
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(SEED), config=offload_config(2, "fp32", offload)
    )
    run_steps(engine, batches[:1], rank)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), tag="step1")
    saved = full_params(engine)
    dist.barrier()
    if rank == 0:
        shutil.rmtree(nvme)
    dist.barrier()
    try:
        run_steps(engine, batches[1:2], rank)
        message = "no error"
    except SwapFileError as error:
        message = str(error)
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(SEED), config=offload_config(2, "fp32", None)
    )
    engine.load_checkpoint(os.path.join(folder, "ckpt"), tag="step1")
    reloaded = full_params(engine)
    run_steps(engine, batches[1:], rank)
    engine.destroy()
    return message, nvme, saved, reloaded


def test_a_vanished_nvme_folder_is_named_and_the_checkpoint_survives(pool2, tmp_path):
    for message, nvme, saved, reloaded in pool2.run(_vanished_folder_job, tmp_path):
        assert nvme in message and "ENOENT" in message, message
        assert "bytes" in message, message
        for name, value in saved.items():
            assert torch.equal(reloaded[name], value), name


# --- step_during_backward (deepspeed_cpp's extension) ------------------------------------------


def _mlp(dtype: str) -> torch.nn.Module:
    """Odd sizes; every parameter gets a gradient in every step (a parameter without one holds
    back every later bucket until backward ends, and nothing would be stepped early)."""
    torch.manual_seed(SEED)
    sizes = (29, 41, 37, 23)
    layers = []
    for width_in, width_out in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers[:-1])
    return model.to(torch.bfloat16) if dtype == "bf16" else model


def _train_counting_early_steps(engine, steps, gas):
    """Trains on this rank's rows of fresh random batches; returns the full parameters and,
    per step, the sub-groups stepped inside its boundary backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(SEED + 1)
    dtype = next(engine.module.parameters()).dtype
    early, norms = [], []
    for _ in range(steps * gas):
        x = torch.randn(3 * world, 29, generator=generator)[3 * rank : 3 * rank + 3]
        y = torch.randn(3 * world, 23, generator=generator)[3 * rank : 3 * rank + 3]
        loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
        engine.backward(loss)
        steps_during_backward = engine.optimizer.stepper.backward_steps
        boundary = engine.is_gradient_accumulation_boundary()
        if steps_during_backward is not None and boundary:
            early.append(steps_during_backward.stepped_count)
        engine.step()
        if boundary:
            norms.append(engine.get_global_grad_norm())
    return full_params(engine), early, norms


def _step_during_backward_job(parent, stage, dtype, device, gas):
    import deepspeed_cpp

    folder = _shared_folder(parent)
    base = {"device": "cpu"} if device == "cpu" else nvme_offload(folder)
    results = []
    # NVMe offload steps during backward when the key is unset (the default): tested so.
    for early in (False, True if device == "cpu" else None):
        offload = {**base, "step_during_backward": early}
        if early is None:
            del offload["step_during_backward"]
        cfg = offload_config(stage, dtype, offload, gas=gas, clip=0.0, sub_group_size=300)
        cfg["zero_optimization"]["reduce_bucket_size"] = 200
        if device == "nvme+pnvme":  # ZeRO-Infinity: the parameter shards on NVMe too
            cfg["zero_optimization"]["offload_param"] = {"device": "nvme", "nvme_path": folder}
        engine, *_ = deepspeed_cpp.initialize(model=_mlp(dtype), config=cfg)
        results.append(_train_counting_early_steps(engine, STEPS, gas))
        results.append(len(engine.optimizer.home.sub_groups))
        engine.destroy()
    return results


@pytest.mark.parametrize(
    "stage, device, dtype, gas",
    [(1, "cpu", "fp32", 2), (1, "nvme", "bf16", 3), (2, "cpu", "bf16", 2),
     (2, "nvme", "fp32", 2), (3, "cpu", "fp32", 1), (3, "nvme", "bf16", 2),
     (3, "nvme+pnvme", "bf16", 1)],
)  # fmt: skip
def test_step_during_backward_is_bitwise_the_step_at_engine_step(
    pool2, tmp_path, stage, device, dtype, gas
):
    for (at_step, _, norms), _, (early, stepped, early_norms), sub_groups in pool2.run(
        _step_during_backward_job, tmp_path, stage, dtype, device, gas
    ):
        # Some sub-groups were stepped inside backward, and not all (the reducer keeps the
        # last buckets in flight until backward ends): both paths ran in every step.
        assert len(stepped) == STEPS and all(0 < n < sub_groups for n in stepped), stepped
        for name, value in at_step.items():
            assert torch.equal(early[name], value), (name, stage, device, dtype)
        # The early steps reuse the shard gradients' storage: the norms engine.step() reports
        # were taken before (bitwise those of the step at engine.step()).
        assert early_norms == norms and all(n > 0 for n in norms), (early_norms, norms)


def _refusals_job(folder):
    import deepspeed_cpp

    early = {"device": "cpu", "step_during_backward": True}
    fp16 = offload_config(2, "fp32", early, clip=0.0)
    fp16["fp16"] = {"enabled": True}
    found = [
        _error_of(offload_config(2, "fp32", early, clip=1.0)),
        _error_of(fp16),
        _error_of(offload_config(2, "fp32", {**early, "delayed_param_update": True}, clip=0.0)),
        _error_of(offload_config(2, "fp32", {**early, "ratio": 0.5}, clip=0.0)),
    ]
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(SEED), config=offload_config(2, "fp32", early, gas=1, clip=0.0)
    )
    from zero3_helpers import global_batches, loss_of, rank_slice

    rank = dist.get_rank()
    (x, y), *_ = global_batches(SEED, 1, 1, 2)[0]
    engine.backward(loss_of(engine(rank_slice(x, rank)), rank_slice(y, rank)))
    try:
        engine.backward(loss_of(engine(rank_slice(x, rank)), rank_slice(y, rank)))
        found.append("no error")
    except RuntimeError as error:
        found.append(f"RuntimeError: {error}")
    try:
        engine.save_checkpoint(folder, tag="between")
        found.append("no error")
    except RuntimeError as error:
        found.append(f"RuntimeError: {error}")
    engine.step()
    engine.save_checkpoint(folder, tag="after")  # fine once the step is done
    engine.destroy()
    # A learning rate changed after some sub-groups were stepped with the old one.
    cfg = offload_config(2, "fp32", early, gas=1, clip=0.0, sub_group_size=300)
    cfg["zero_optimization"]["reduce_bucket_size"] = 200
    engine, *_ = deepspeed_cpp.initialize(model=_mlp("fp32"), config=cfg)
    engine.backward(torch.nn.functional.mse_loss(engine(torch.randn(3, 29)), torch.randn(3, 23)))
    assert engine.optimizer.stepper.backward_steps.stepped_count > 0
    engine.optimizer.param_groups[0]["lr"] *= 2
    try:
        engine.step()
        found.append("no error")
    except RuntimeError as error:
        found.append(f"RuntimeError: {error}")
    engine.destroy()
    # Unset, it stays off without a word where something excludes it (clipping here).
    nvme = nvme_offload(_shared_folder(folder))
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(SEED), config=offload_config(2, "fp32", nvme)
    )
    found.append(engine.optimizer.stepper.backward_steps)
    engine.destroy()
    return found


def test_step_during_backward_refuses_what_needs_every_gradient_first(pool2, tmp_path):
    key = "zero_optimization.offload_optimizer.step_during_backward = true cannot be combined"
    for clip, fp16, delayed, ratio, twice, save, lr, unset in pool2.run(
        _refusals_job, str(tmp_path)
    ):
        for message in (clip, fp16, delayed, ratio):
            assert message.startswith("DeepSpeedConfigError") and key in message, message
        assert "gradient_clipping = 1.0" in clip
        assert "fp16.enabled = true" in fp16
        assert "offload_optimizer.delayed_param_update = true" in delayed
        assert "offload_optimizer.ratio = 0.5" in ratio
        assert "backward() was called again before engine.step()" in twice, twice
        assert "saving a checkpoint between an accumulation boundary's backward" in save, save
        assert "param_groups[0]['lr'] changed from 0.01 to 0.02 between backward" in lr, lr
        assert unset is None


def _step_during_backward_vanished_folder_job(parent):
    import shutil

    import deepspeed_cpp

    folder = _shared_folder(parent)
    offload = {**nvme_offload(folder), "step_during_backward": True}
    cfg = offload_config(2, "fp32", offload, gas=1, clip=0.0, sub_group_size=300)
    cfg["zero_optimization"]["reduce_bucket_size"] = 200
    engine, *_ = deepspeed_cpp.initialize(model=_mlp("fp32"), config=cfg)
    x, y = torch.randn(3, 29), torch.randn(3, 23)
    for step in range(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        if step == 0:
            engine.step()
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(folder)  # the swap folder vanishes between two steps
            dist.barrier()
    try:
        engine.step()
        message = "no error"
    except RuntimeError as error:
        message = f"{error} <- {error.__cause__!r}"
    engine.destroy()
    return message


def test_a_failed_step_during_backward_is_raised_by_engine_step(pool2, tmp_path):
    for message in pool2.run(_step_during_backward_vanished_folder_job, tmp_path):
        assert re.search(r"step_during_backward: stepping optimizer sub-group \d+ during", message)
        assert "ENOENT (2)" in message, message
