"""Steps whose global gradient holds NaN or inf, on 2 real gloo ranks.

One rank's loss is multiplied by NaN or inf at one step, so every gradient element of that rank
is NaN or inf and, after the reduction, so is every rank's. The run must equal, bitwise, the same
run in which that step's batch was never trained (no forward, backward or step): parameters after
the last step, learning rate (the LR schedule did not move), with one step counted as skipped.
Every ZeRO stage, fp32/bf16/fp16, and the offload paths (cpu, NVMe with its steps during
backward, the delayed parameter update) that step the optimizer elsewhere.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

STEPS, BAD_STEP, MICRO = 6, 3, 2
SIZES = (5, 9, 7, 3)
# With offload: every rank's shard of every sub-group holds real elements, not only padding (a
# shard of padding sees no NaN and is stepped during backward: see the partly-taken test).
OFFLOAD_SIZES = (29, 41, 37, 23)


def _model(seed: int, sizes=SIZES) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for width_in, width_out in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _config(stage: int, dtype: str, *, gas: int = 1, zero_extra=None, extra=None) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 5},
        },
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 40,
            "stage3_param_persistence_threshold": 0,
            **(zero_extra or {}),
        },
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
    config.update(extra or {})
    return config


class _Messages(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run(
    config: dict,
    seed: int,
    *,
    poison=None,
    omit=None,
    sizes=SIZES,
    mid_backward=False,
    optimizer_state=False,
):
    """Trains ``STEPS`` steps of this rank's rows of fixed random batches. ``poison``: the
    factor the last rank's loss is multiplied by at step ``BAD_STEP`` (every micro-step of
    it), or with ``mid_backward`` the value written into one element of the first layer's
    weight gradient on the last rank (that gradient comes last in backward, after the other
    layers' sub-groups were stepped during backward); ``omit``: that step's batch is not
    trained at all (the reference); ``optimizer_state``: the result holds it too."""
    import deepspeed_cpp
    from deepspeed_cpp.utils.logging import logger

    rank, world = dist.get_rank(), dist.get_world_size()
    engine, *_ = deepspeed_cpp.initialize(model=_model(seed, sizes), config=config)
    messages = _Messages()
    logger.addHandler(messages)
    generator = torch.Generator().manual_seed(seed + 1)
    model_dtype = next(engine.module.parameters()).dtype
    early, stepped_early = [], []
    first_weight = engine.module[0].weight
    try:
        for step in range(STEPS):
            micro_batches = [
                (torch.randn(MICRO * world, sizes[0], generator=generator),
                 torch.randn(MICRO * world, sizes[-1], generator=generator))
                for _ in range(engine.gradient_accumulation_steps())
            ]  # fmt: skip
            if step == BAD_STEP and omit:
                continue
            for x, y in micro_batches:
                rows = slice(rank * MICRO, (rank + 1) * MICRO)
                loss = torch.nn.functional.mse_loss(
                    engine(x[rows].to(model_dtype)).float(), y[rows]
                )
                hook = None
                if step == BAD_STEP and poison is not None and rank == world - 1:
                    if mid_backward:
                        hook = first_weight.register_hook(
                            lambda g: (
                                g.flatten().index_fill(0, torch.tensor([0]), poison).view_as(g)
                            )
                        )
                    else:
                        loss = loss * torch.tensor(poison)
                engine.backward(loss)
                if hook is not None:
                    hook.remove()
                stepper = getattr(engine.optimizer, "stepper", None)
                backward_steps = getattr(stepper, "backward_steps", None)
                if backward_steps is not None and engine.is_gradient_accumulation_boundary():
                    early.append(backward_steps.stepped_count)
                    # Those the worker stepped (not declined), waiting for it to finish them.
                    futures = backward_steps._stepped.values()
                    stepped_early.append(sum(f.result() is not None for f in futures))
                engine.step()
    finally:
        logger.removeHandler(messages)
    state = {
        name: value.detach().float().cpu().clone()
        for name, value in engine.full_module_state_dict().items()
    }
    result = {
        "params": state,
        "lr": engine.get_lr(),
        "skipped": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "loss_scale": engine.get_loss_scale(),
        "logged": [line for line in messages.lines if "at step" in line],
        "early": early,
        "stepped_early": stepped_early,
    }
    if optimizer_state:
        result["optimizer_state"] = _optimizer_state(engine)
    engine.destroy()
    return result


def _optimizer_state(engine) -> dict:
    """Every parameter's Adam moments (whole, gathered) and every master's step count."""
    from deepspeed_cpp.utils import safe_get_full_optimizer_state

    state = {
        f"{name}.{key}": safe_get_full_optimizer_state(param, key).float().clone()
        for name, param in engine.module.named_parameters()
        for key in ("exp_avg", "exp_avg_sq")
    }
    stage = engine.optimizer
    for bucket, master in enumerate(stage.masters):
        outline = stage.home.state_outline(bucket)  # NVMe: the in-memory part of its state
        entries = outline[0] if outline is not None else stage.optimizer.state[master]
        state[f"step of master {bucket}"] = torch.as_tensor(entries["step"]).clone()
    return state


def _poisoned_and_reference_job(config: dict, seed: int, poisons: tuple[str, ...], sizes=SIZES):
    reference = _run(config, seed, omit=True, sizes=sizes)
    return reference, {k: _run(config, seed, poison=float(k), sizes=sizes) for k in poisons}


def _assert_skipped_like_reference(results, poisons, fp16=False):
    for rank, (reference, poisoned) in enumerate(results):
        assert reference["skipped"] == 0 and reference["global_steps"] == STEPS - 1
        for kind in poisons:
            run = poisoned[kind]
            assert run["skipped"] == 1, (kind, rank, run["skipped"])
            assert run["global_steps"] == STEPS, (kind, rank)
            assert run["lr"] == reference["lr"], (kind, rank, run["lr"], reference["lr"])
            for name, value in reference["params"].items():
                assert torch.isfinite(run["params"][name]).all(), (kind, rank, name)
                assert torch.equal(run["params"][name], value), (kind, rank, name)
            if fp16:  # the loss scaler's overflow: the scale was lowered once (hysteresis 1)
                assert run["loss_scale"] == reference["loss_scale"] / 2, (kind, rank)
                continue
            expected = f"non-finite gradients at step {BAD_STEP}"
            logged = [line for line in run["logged"] if expected in line]
            assert len(logged) == (1 if rank == 0 else 0), (kind, rank, run["logged"])
            # inf times a zero gradient element is NaN: an inf loss may give either norm.
            assert not logged or "norm nan" in logged[0] or "norm inf" in logged[0], logged


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_nonfinite_step_is_skipped_on_every_rank_like_a_step_never_taken(pool2, stage, dtype):
    seed = int(torch.randint(0, 2**31 - 1, ()))
    poisons = ("nan", "inf")
    results = pool2.run(_poisoned_and_reference_job, _config(stage, dtype), seed, poisons)
    _assert_skipped_like_reference(results, poisons, fp16=dtype == "fp16")


def _shared_folder(parent) -> str:
    names = [tempfile.mkdtemp(dir=parent) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def _offload_job(parent, stage: int, dtype: str, offload: dict, gas: int, clip: float):
    if offload["device"] == "nvme":
        offload = {**offload, "nvme_path": _shared_folder(parent)}
    zero = {"offload_optimizer": offload, "sub_group_size": 300, "reduce_bucket_size": 200}
    config = _config(stage, dtype, gas=gas, zero_extra=zero, extra={"gradient_clipping": clip})
    return _poisoned_and_reference_job(config, 5, ("nan",), OFFLOAD_SIZES)


@pytest.mark.parametrize(
    "stage, dtype, offload, gas, clip",
    [
        (1, "bf16", {"device": "cpu"}, 2, 1.0),
        (2, "fp32", {"device": "cpu", "delayed_param_update": True,
                     "delayed_param_update_warmup_steps": 1}, 1, 1.0),
        (2, "fp32", {"device": "nvme"}, 1, 0.0),  # steps during backward (NVMe's default)
        (3, "bf16", {"device": "nvme"}, 2, 0.0),
        (3, "fp32", {"device": "cpu", "ratio": 0.5}, 1, 1.0),
    ],
)  # fmt: skip
def test_offloaded_optimizer_steps_skip_too(pool2, tmp_path, stage, dtype, offload, gas, clip):
    results = pool2.run(_offload_job, tmp_path, stage, dtype, offload, gas, clip)
    _assert_skipped_like_reference(results, ("nan",))
    if offload["device"] == "nvme":
        for _, poisoned in results:
            # Sub-groups were handed to the backward worker in every step, the poisoned one
            # included (it declined them): the early-step path was the one tested.
            assert all(count > 0 for count in poisoned["nan"]["early"]), poisoned["nan"]["early"]


# --- "raise", and a NaN that appears after sub-groups were stepped during backward ---------


def _raise_job(stage: int):
    import deepspeed_cpp
    from deepspeed_cpp.runtime.nonfinite_gradients import NonFiniteGradientError

    rank = dist.get_rank()
    config = _config(stage, "fp32", extra={"nonfinite_gradients": "raise"})
    engine, *_ = deepspeed_cpp.initialize(model=_model(3), config=config)
    x, y = torch.randn(MICRO, SIZES[0]), torch.randn(MICRO, SIZES[-1])
    errors, before = [], None
    for step in range(3):
        loss = torch.nn.functional.mse_loss(engine(x), y)
        if step == 1:
            before = {n: v.clone() for n, v in engine.full_module_state_dict().items()}
            loss = loss * (float("nan") if rank == 1 else 1.0)
        engine.backward(loss)
        try:
            engine.step()
        except NonFiniteGradientError as error:
            errors.append(str(error))
            after = engine.full_module_state_dict()
            errors.append(all(torch.equal(after[n], v) for n, v in before.items()))
    return errors, engine.skipped_steps, engine.global_steps


@pytest.mark.parametrize("stage", [1, 3])
def test_raise_mode_raises_on_every_rank_after_skipping(pool2, stage):
    for errors, skipped, global_steps in pool2.run(_raise_job, stage):
        assert len(errors) == 2, errors  # one error, then the engine trained on
        message, unchanged = errors
        assert "non-finite gradients at step 1" in message and "norm nan" in message
        assert "nonfinite_gradients = 'raise'" in message
        assert unchanged
        assert skipped == 1 and global_steps == 3


def _mid_backward_job(parent, stage: int, dtype: str, device: str):
    """A reference run that never trains step ``BAD_STEP``, then runs in which one element of
    the first layer's gradient becomes NaN or inf on the last rank during that step's backward,
    after the later layers' sub-groups were stepped during backward with finite gradients."""
    offload = {"device": device, "step_during_backward": True}
    if device == "nvme":
        offload["nvme_path"] = _shared_folder(parent)
    zero = {"offload_optimizer": offload, "sub_group_size": 300, "reduce_bucket_size": 200}
    config = _config(stage, dtype, zero_extra=zero, extra={"gradient_clipping": 0.0})
    seed = int(torch.randint(0, 2**31 - 1, ()))
    seeds = [seed]
    dist.broadcast_object_list(seeds, src=0)
    run = functools.partial(_run, config, seeds[0], sizes=OFFLOAD_SIZES, optimizer_state=True)
    runs = {"reference": run(omit=True)}
    for kind in ("nan", "inf"):
        runs[kind] = run(poison=float(kind), mid_backward=True)
    return runs


@pytest.mark.parametrize(
    "stage, dtype, device",
    [(2, "fp32", "nvme"), (3, "bf16", "nvme"), (2, "bf16", "cpu")],
)
def test_a_step_partly_taken_during_backward_is_skipped_whole(
    pool2, tmp_path, stage, dtype, device
):
    """The sub-groups stepped during backward before the NaN/inf appeared are undone: the run
    equals, bitwise, the reference that never trained the step (parameters, Adam moments and
    step counts, LR), with the step counted as skipped."""
    results = pool2.run(_mid_backward_job, tmp_path, stage, dtype, device)
    _assert_skipped_like_reference([(r["reference"], r) for r in results], ("nan", "inf"))
    for rank, runs in enumerate(results):
        reference = runs["reference"]["optimizer_state"]
        for kind in ("nan", "inf"):
            run = runs[kind]
            # Every rank really stepped sub-groups during the poisoned step's backward (and
            # every other one), with finite gradients: the discarded path was the one taken.
            assert all(count > 0 for count in run["stepped_early"]), (kind, rank, run)
            assert run["optimizer_state"].keys() == reference.keys()
            for name, value in reference.items():
                assert torch.equal(run["optimizer_state"][name], value), (kind, rank, name)
            steps = [v for k, v in reference.items() if k.startswith("step of")]
            assert steps and all(float(v) == STEPS - 1 for v in steps), steps


# --- save_checkpoint refuses weights that are not finite --------------------------------------


def _save_job(parent, stage: int):
    import deepspeed_cpp
    from deepspeed_cpp.runtime.checkpoint import NonFiniteParametersError
    from deepspeed_cpp.runtime.zero import partition_parameters as pp

    folder = _shared_folder(parent)
    engine, *_ = deepspeed_cpp.initialize(model=_model(2), config=_config(stage, "fp32"))
    x, y = torch.randn(MICRO, SIZES[0]), torch.randn(MICRO, SIZES[-1])
    for _ in range(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    engine.save_checkpoint(folder)
    weight = engine.module[2].weight
    with torch.no_grad():
        if not pp.is_zero_param(weight):  # replicated: as a NaN step would leave every rank
            weight.view(-1)[0] = float("nan")
        elif dist.get_rank() == 1:  # the first element of rank 1's shard, on rank 1 only
            weight.ds_tensor.view(-1)[0] = float("nan")
    engine.global_steps += 1  # a new tag
    try:
        engine.save_checkpoint(folder)
        error = None
    except NonFiniteParametersError as caught:
        error = str(caught)
    dist.barrier()  # rank 0 has removed the refused save's staging folder
    with open(os.path.join(folder, "latest")) as latest:
        return error, latest.read().strip(), sorted(os.listdir(folder))


@pytest.mark.parametrize("stage", [1, 3])
def test_save_checkpoint_refuses_parameters_that_are_not_finite(pool2, tmp_path, stage):
    for error, latest, names in pool2.run(_save_job, tmp_path, stage):
        assert error is not None and "parameter '2.weight'" in error, error
        assert "not finite" in error and "latest" in error, error
        assert latest == "global_step2"
        assert not [name for name in names if name.startswith("global_step3")], names
