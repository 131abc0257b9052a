"""Offload corner cases found in review: a load while a delayed step is pending, a partial
offload with an optimizer that cannot step part of its tensors, a parameter offload that fails
half-way, NVMe read-ahead when parameters are released between forward and backward, and an
NVMe swap write past the file size limit (RLIMIT_FSIZE) in the middle of a step; and
DeepSpeed's ``zero_force_ds_cpu_optimizer`` (a client optimizer with optimizer offload)."""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from offload_helpers import SEED, offload_config, run_steps, shard_states
from zero3_helpers import (
    MICRO_BATCH,
    assert_same_shard_states,
    full_params,
    global_batches,
    make_model,
)


def _folder(parent) -> str:
    names = [tempfile.mkdtemp(dir=parent) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    return names[0]


def _load_while_delayed_job(parent, stage, module_only):
    import deepspeed_cpp

    checkpoint = _folder(parent)
    offload = {"device": "cpu", "delayed_param_update": True,
               "delayed_param_update_warmup_steps": 0}  # fmt: skip
    batches = global_batches(SEED, 4, 2, dist.get_world_size())
    engine, *_ = deepspeed_cpp.initialize(
        model=make_model(SEED), config=offload_config(stage, "fp32", offload)
    )
    run_steps(engine, batches[:2], dist.get_rank())
    engine.save_checkpoint(checkpoint, tag="t")
    saved = full_params(engine)
    run_steps(engine, batches[2:], dist.get_rank())  # a delayed step is pending now
    engine.load_checkpoint(checkpoint, tag="t", load_module_only=module_only)
    # What the model holds right after the load (stages 1-2 keep parameters whole), and what
    # a consolidated read gives (it finishes pending work first).
    live = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    after = full_params(engine)
    engine.destroy()
    return saved, (live if stage != 3 else after), after


@pytest.mark.parametrize("stage, module_only", [(2, False), (2, True), (3, True)])
def test_a_load_drops_the_pending_delayed_step(pool2, tmp_path, stage, module_only):
    for saved, live, after in pool2.run(_load_while_delayed_job, tmp_path, stage, module_only):
        for name, value in saved.items():
            assert torch.equal(live[name], value), name
            assert torch.equal(after[name], value), name


def _partial_sgd_job():
    import deepspeed_cpp

    cfg = offload_config(2, "fp32", {"device": "cpu", "ratio": 0.5})
    cfg["optimizer"] = {"type": "SGD", "params": {"lr": 0.01, "momentum": 0.9}}
    try:
        deepspeed_cpp.initialize(model=make_model(SEED), config=cfg)
    except ValueError as error:
        return str(error)
    return "no error"


def test_partial_offload_refuses_an_optimizer_that_steps_all_tensors_at_once(pool2):
    for message in pool2.run(_partial_sgd_job):
        assert "ratio < 1" in message and "SGD cannot" in message, message


class _TwoSizes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.small = torch.nn.Linear(16, 16, bias=False)
        self.big = torch.nn.Linear(16, 256, bias=False)

    def forward(self, x):
        return self.big(torch.tanh(self.small(x)))


def _failed_adoption_job(parent):
    import deepspeed_cpp

    folder = _folder(parent)
    torch.manual_seed(0)
    model = _TwoSizes()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def config(buffer_size):
        return {"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                      "offload_optimizer": {"device": "cpu"},
                                      "offload_param": {"device": "nvme", "nvme_path": folder,
                                                        "buffer_size": buffer_size}}}  # fmt: skip

    try:
        deepspeed_cpp.initialize(model=model, config=config(1024))
        message = "no error"
    except ValueError as error:
        message = str(error)
    devices = {str(p.ds_tensor.device) for p in model.parameters()}
    engine, *_ = deepspeed_cpp.initialize(model=model, config=config(4096))
    after = full_params(engine)
    engine.destroy()
    return message, devices, before, after


def test_a_parameter_offload_that_fails_leaves_the_model_usable(pool2, tmp_path):
    for message, devices, before, after in pool2.run(_failed_adoption_job, tmp_path):
        assert "offload_param.buffer_size = 1024" in message and "'big.weight'" in message
        assert devices == {"cpu"}  # every shard back on the device, none left on NVMe
        for name, value in before.items():
            assert torch.equal(after[name], value), name


def _eight_layers_with_nvme_parameters(parent, **zero):
    """An engine over 8 bias-free 64x64 layers whose parameters live on NVMe and are released
    after forward and gathered again in backward (reversed order)."""
    import deepspeed_cpp

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(8)])
    cfg = {"gradient_clipping": 0.0, "train_micro_batch_size_per_gpu": 4,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {
               "stage": 3, "stage3_param_persistence_threshold": 0,
               "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
               "offload_optimizer": {"device": "cpu"},
               "offload_param": {"device": "nvme", "nvme_path": _folder(parent),
                                 "buffer_count": 3, "buffer_size": 4096},
               **zero}}  # fmt: skip
    engine, *_ = deepspeed_cpp.initialize(model=model, config=cfg)
    return engine


def _read_ahead_job(parent):
    engine = _eight_layers_with_nvme_parameters(parent, stage3_prefetch_bucket_size=0)
    home = engine.optimizer.param_home
    generator, counts = torch.Generator().manual_seed(1), []
    for _ in range(4):
        engine.backward(engine(torch.randn(4, 64, generator=generator)).pow(2).mean())
        engine.step()
        counts.append((home.read_ahead_hits, home.reads_on_demand))
    engine.destroy()
    return counts


def test_nvme_read_ahead_follows_backward_order_too(pool2, tmp_path):
    for counts in pool2.run(_read_ahead_job, tmp_path):
        # The first pass records (and its order still holds its own first-use gathers); from
        # the third step on, every fetch, forward and backward, was read ahead.
        (hits_second, on_demand_second), (hits_last, on_demand_last) = counts[1], counts[-1]
        assert on_demand_last == on_demand_second, counts
        assert hits_last - hits_second == 2 * 16, counts  # 8 layers, forward and backward


def _evaluation_only_job(parent):
    engine = _eight_layers_with_nvme_parameters(parent)
    engine.eval()
    home, longest = engine.optimizer.param_home, 0
    with torch.no_grad():
        for _ in range(30):
            engine(torch.randn(4, 64))
            longest = max(longest, len(home._recording))
    result = (home.read_ahead_hits, home.reads_on_demand, longest)
    engine.destroy()
    return result


def test_evaluation_only_passes_read_ahead_and_record_a_bounded_order(pool2, tmp_path):
    for hits, on_demand, longest in pool2.run(_evaluation_only_job, tmp_path):
        assert longest <= 4 * 8 + 64 + 1  # the recording is cut into an order, not kept growing
        assert hits > on_demand, (hits, on_demand)  # later passes read ahead


def _delayed_resume_job(parent):
    """A run with the delayed update saved at step 3 and resumed equals the run that saved."""
    import deepspeed_cpp

    checkpoint = _folder(parent)
    offload = {"device": "cpu", "delayed_param_update": True,
               "delayed_param_update_warmup_steps": 2}  # fmt: skip
    rank, batches = dist.get_rank(), global_batches(SEED, 6, 2, dist.get_world_size())

    def engine_for():
        engine, *_ = deepspeed_cpp.initialize(
            model=make_model(SEED), config=offload_config(2, "fp32", offload)
        )
        return engine

    engine = engine_for()
    run_steps(engine, batches[:3], rank)
    engine.save_checkpoint(checkpoint, tag="step3")
    run_steps(engine, batches[3:], rank)
    saved_and_went_on = full_params(engine)
    engine.destroy()
    engine = engine_for()
    engine.load_checkpoint(checkpoint, tag="step3")
    run_steps(engine, batches[3:], rank)
    resumed = full_params(engine)
    engine.destroy()
    return saved_and_went_on, resumed


def test_a_resumed_delayed_update_run_continues_past_its_warm_up(pool2, tmp_path):
    for saved_and_went_on, resumed in pool2.run(_delayed_resume_job, tmp_path):
        for name, value in saved_and_went_on.items():
            assert torch.equal(resumed[name], value), name


def _file_size_limit_job(parent):
    """An NVMe ZeRO-2 engine whose swap write hits RLIMIT_FSIZE in the middle of a step."""
    import errno
    import os
    import resource

    import deepspeed_cpp
    from deepspeed_cpp.runtime.failed_step import FailedStepError
    from deepspeed_cpp.runtime.zero.offload import SwapFileError

    rank, folder = dist.get_rank(), _folder(parent)
    batches = global_batches(SEED, 2, 2, dist.get_world_size())

    def engine_swapping_to(name):
        nvme = os.path.join(folder, name)
        os.makedirs(nvme, exist_ok=True)
        offload = {"device": "nvme", "nvme_path": nvme}
        config = offload_config(2, "fp32", offload)
        return deepspeed_cpp.initialize(model=make_model(SEED), config=config)[0], nvme

    engine, nvme = engine_swapping_to("nvme")
    run_steps(engine, batches[:1], rank)
    engine.save_checkpoint(os.path.join(folder, "ckpt"), tag="step1")
    saved_params, saved_states = full_params(engine), shard_states(engine)
    before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    # Every rank owns slices of the same sizes (padded to the world size), so every rank's first
    # sub-group write passes the limit at the same point of the step: no rank is left waiting.
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, hard))
    try:
        run_steps(engine, batches[1:], rank)
        failure = None
    except SwapFileError as error:
        failure = (str(error), error.errno, error.nbytes, error.filename)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    steps_after = engine.global_steps
    refusals = []  # the part-updated engine neither trains on nor saves
    train_on = lambda: run_steps(engine, batches[1:], rank)  # noqa: E731
    save = lambda: engine.save_checkpoint(os.path.join(folder, "ckpt"), tag="mixed")  # noqa: E731
    for call in (train_on, save):
        try:
            call()
            refusals.append(None)
        except FailedStepError as error:
            refusals.append(str(error))
    # A whole checkpoint load replaces everything the step touched: the same engine goes on.
    engine.load_checkpoint(os.path.join(folder, "ckpt"), tag="step1")
    run_steps(engine, batches[1:], rank)
    recovered = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    fresh, _ = engine_swapping_to("nvme_after")
    fresh.load_checkpoint(os.path.join(folder, "ckpt"), tag="step1")
    loaded_params, loaded_states = full_params(fresh), shard_states(fresh)
    run_steps(fresh, batches[1:], rank)  # the step the limit cut short, done whole
    stepped = {n: p.detach().clone() for n, p in fresh.module.named_parameters()}
    fresh.destroy()
    # Each element of the model is either what it was before the step or what the whole step
    # makes it (the sub-groups stepped before the failed write copied their values out).
    neither = sum(int(((after[n] != before[n]) & (after[n] != stepped[n])).sum()) for n in after)
    changed = sum(int((after[n] != before[n]).sum()) for n in after)
    return {
        "failure": failure, "efbig": errno.EFBIG, "nvme": nvme, "neither": neither,
        "changed": changed, "steps": (1, steps_after), "refusals": refusals,
        "recovered_equal": all(torch.equal(recovered[n], stepped[n]) for n in stepped),
        "mixed_saved": os.path.exists(os.path.join(folder, "ckpt", "mixed")),
        "saved": (saved_params, saved_states), "loaded": (loaded_params, loaded_states),
    }  # fmt: skip


def test_a_swap_write_past_the_file_size_limit_is_named_and_nothing_is_lost(pool2, tmp_path):
    """RLIMIT_FSIZE below the swap files mid-training: the step raises a SwapFileError naming
    the swap file, its bytes and EFBIG; every element of the model is its value before the step
    or after the whole step (never anything else), the step is not counted, and the engine
    refuses to train on or save that mix until a checkpoint is loaded; the last checkpoint
    loads into a fresh NVMe engine with every parameter, master slice and optimizer state
    bitwise as saved."""
    for result in pool2.run(_file_size_limit_job, tmp_path):
        assert result["failure"] is not None, "the step passed the file size limit"
        message, code, nbytes, path = result["failure"]
        assert code == result["efbig"] and "EFBIG (27): File too large" in message, message
        assert path.startswith(result["nvme"]) and path in message, (path, message)
        assert nbytes > 8192 and f"{nbytes} bytes" in message, message
        assert result["neither"] == 0, result["changed"]
        assert result["steps"][1] == result["steps"][0]  # the failed step is not counted
        for refusal, call in zip(result["refusals"], ("engine.forward", "engine.save_checkpoint")):
            assert refusal is not None, f"{call} went on after the failed step"
            assert refusal.startswith(call) and "global step 1 failed (SwapFileError" in refusal
            assert "engine.load_checkpoint" in refusal, refusal
        assert not result["mixed_saved"]
        assert result["recovered_equal"]  # reloaded in place, the step done whole
        (saved_params, saved_states), (params, states) = result["saved"], result["loaded"]
        for name, value in saved_params.items():
            assert torch.equal(params[name], value), name
        assert_same_shard_states(states, saved_states)


def _inference_offload_param_job():
    import deepspeed_cpp

    zero = {"stage": 3, "offload_param": {"device": "cpu"},
            "stage3_param_persistence_threshold": 0}  # fmt: skip
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "zero_optimization": zero,
    }
    reference = make_model(SEED)
    tokens = global_batches(SEED, 1, 1, dist.get_world_size())[0][0][0]
    with torch.no_grad():
        expected = reference(tokens)
    # ZeRO Inference (the guide's t0.py): offload_param without an optimizer to step.
    engine, *_ = deepspeed_cpp.initialize(model=make_model(SEED), config=config)
    engine.module.eval()
    with torch.no_grad():
        got = engine(tokens)
    partitioned = all(p.numel() == 0 for p in engine.module.parameters())
    engine.destroy()
    # With an optimizer and no offload_optimizer, DeepSpeed keeps the parameter shards in host
    # memory and steps on the device: on a CPU device that is where they are anyway, so it
    # trains exactly as without offload_param (a client optimizer and the config's Adam).
    batches = global_batches(SEED, 2, 1, dist.get_world_size())
    trained = []
    for offload in (True, False):
        for client in (True, False):
            zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
            if offload:
                zero["offload_param"] = {"device": "cpu", "pin_memory": True}
            cfg = dict(config, zero_optimization=zero)
            model = make_model(SEED)
            if client:
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                engine, *_ = deepspeed_cpp.initialize(model=model, optimizer=optimizer, config=cfg)
            else:
                cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
                engine, *_ = deepspeed_cpp.initialize(model=model, config=cfg)
            run_steps(engine, batches, dist.get_rank())
            trained.append(full_params(engine))
            engine.destroy()
    alike = [
        all(torch.equal(a[name], b[name]) for name in a)
        for a, b in ((trained[0], trained[2]), (trained[1], trained[3]))
    ]
    moved = any(not torch.equal(trained[0][n], trained[1][n]) for n in trained[0])
    gap = (got - expected).abs().max().item()
    return torch.equal(got, expected), gap, partitioned, alike, moved


def test_offload_param_without_an_optimizer_runs_inference(pool2):
    for same, gap, partitioned, alike, moved in pool2.run(_inference_offload_param_job):
        assert same, gap
        assert partitioned
        assert alike == [True, True]  # offload_param alone on a CPU device: the same training
        assert moved  # SGD and Adam trained (differently): the comparison is not vacuous


def _client_optimizer_with_offload_job(force):
    import deepspeed_cpp
    from deepspeed_cpp.ops.adam import DeepSpeedCPUAdam
    from deepspeed_cpp.runtime.zero.utils import ZeRORuntimeException

    found = {}
    for stage in (2, 3):
        cfg = offload_config(stage, "fp32", {"device": "cpu"})
        del cfg["optimizer"]
        if force is not None:
            cfg["zero_force_ds_cpu_optimizer"] = force
        for kind in ("torch", "callable", "cpu_adam"):
            model = make_model(SEED)
            if kind == "torch":
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            elif kind == "callable":
                optimizer = lambda groups: torch.optim.AdamW(groups, lr=1e-2)  # noqa: E731
            else:
                optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-2)
            try:
                engine, *_ = deepspeed_cpp.initialize(model=model, optimizer=optimizer, config=cfg)
                run_steps(engine, global_batches(SEED, 1, 2, dist.get_world_size()), 0)
                engine.destroy()
                found[stage, kind] = "trained"
            except ZeRORuntimeException as error:
                found[stage, kind] = str(error)
    return found


@pytest.mark.parametrize("force", [None, False])
def test_zero_force_ds_cpu_optimizer_refuses_a_torch_optimizer_with_offload(pool2, force):
    """DeepSpeed's ``zero_force_ds_cpu_optimizer`` (default true): with optimizer offload, an
    optimizer passed to initialize() must be a CPU one (checked on what a callable builds)."""
    for found in pool2.run(_client_optimizer_with_offload_job, force):
        for stage in (2, 3):
            assert found[stage, "cpu_adam"] == "trained"
            for kind in ("torch", "callable"):
                if force is False:
                    assert found[stage, kind] == "trained"
                else:
                    message = found[stage, kind]
                    assert "(AdamW) that is not a CPU optimizer" in message, message
                    assert '"zero_force_ds_cpu_optimizer": false' in message, message


def test_hf_integration_swaps_a_torch_optimizer_for_a_cpu_one_with_offload():
    """As accelerate does for DeepSpeed: the Trainer's optimizer becomes DeepSpeedCPUAdam (or
    -Adagrad) over the same param groups, lr and weight decay, when the engine would refuse it."""
    from deepspeed_cpp.integrations.hf.accelerator import cpu_optimizer_for_offload
    from deepspeed_cpp.optim import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam

    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2))]
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    adamw = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, betas=(0.8, 0.9))
    swapped = cpu_optimizer_for_offload(adamw, offload)
    assert isinstance(swapped, DeepSpeedCPUAdam) and swapped.defaults["adamw_mode"] is True
    group = swapped.param_groups[0]
    assert group["params"] == params and group["lr"] == 3e-3 and group["weight_decay"] == 0.1
    assert group["betas"] == (0.8, 0.9)
    adam = cpu_optimizer_for_offload(torch.optim.Adam(params, lr=1e-3), offload)
    assert isinstance(adam, DeepSpeedCPUAdam) and adam.defaults["adamw_mode"] is False
    adagrad = cpu_optimizer_for_offload(torch.optim.Adagrad(params, lr=0.1), offload)
    assert isinstance(adagrad, DeepSpeedCPUAdagrad)
    assert cpu_optimizer_for_offload(adamw, {"zero_optimization": {"stage": 2}}) is adamw
    allowed = {**offload, "zero_force_ds_cpu_optimizer": False}
    assert cpu_optimizer_for_offload(adamw, allowed) is adamw
