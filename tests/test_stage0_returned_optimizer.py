"""What ``initialize()`` hands back as the optimizer, and which Adam class the config builds, as
DeepSpeed 0.19.8 does (measured with ``DS_ACCELERATOR=cpu`` on 2 gloo ranks, torch 2.14.1):

- ZeRO stage 0 in fp32: the torch optimizer itself, no wrapper: the client's own object
  (``returned is client``), the AdamW a callable built, the config's ``FusedAdam``;
- the config's Adam/AdamW without offload is ``FusedAdam`` (DeepSpeed's CPU accelerator builds
  it too), with ``offload_optimizer`` ``DeepSpeedCPUAdam`` (``engine.optimizer.optimizer``).

Ours steps the returned object inside the stage-0 wrapper, which reduces the gradients during
``engine.backward``; the test trains with the script calling ``returned.zero_grad()`` each step
(the torch habit, which drops the ``.grad`` references) and compares with torch's Adam on the
whole batch in float64, and again with the script stepping and clearing the returned optimizer
itself instead of calling ``engine.step()`` (which, on DeepSpeed, is plain torch training).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MICRO, STEPS, LR = 2, 3, 0.05


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))


def _batches(seed: int, world: int):
    generator = torch.Generator().manual_seed(seed + 1)
    return [
        (torch.randn(MICRO * world, 6, generator=generator),
         torch.randn(MICRO * world, 1, generator=generator))
        for _ in range(STEPS)
    ]  # fmt: skip


def returned_optimizer_job(seed: int) -> dict:
    import deepspeed_cpp as deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    base = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 0.0}
    out = {}
    model = _net(seed)
    client = torch.optim.Adam(model.parameters(), lr=LR)
    config = dict(base, zero_optimization={"stage": 0})
    engine, returned, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
    out["client"] = (
        returned is client,
        type(returned).__name__,
        engine.optimizer.optimizer is client,
    )
    for x, y in _batches(seed, world):
        returned.zero_grad()  # set_to_none: the engine must still step with the reduced grads
        part = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(torch.nn.functional.mse_loss(engine(x[part]), y[part]))
        engine.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]

    # The script steps and clears the handed-back optimizer itself, without engine.step() (on
    # DeepSpeed that is the torch optimizer over the model): the same training.
    model = _net(seed)
    client = torch.optim.Adam(model.parameters(), lr=LR)
    engine, returned, _, _ = deepspeed.initialize(model=model, optimizer=client, config=config)
    for x, y in _batches(seed, world):
        part = slice(rank * MICRO, (rank + 1) * MICRO)
        engine.backward(torch.nn.functional.mse_loss(engine(x[part]), y[part]))
        returned.step()
        returned.zero_grad()
    out["params_direct"] = [p.detach().clone() for p in model.parameters()]

    model = _net(seed)
    engine, returned, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config,
        optimizer=lambda groups: torch.optim.AdamW(groups, lr=LR),
    )  # fmt: skip
    out["callable"] = (type(returned).__name__, returned is engine.optimizer.optimizer)

    for stage, offload in ((0, False), (2, False), (2, True)):
        model = _net(seed)
        zero = {"stage": stage}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = dict(base, zero_optimization=zero, optimizer={"type": "Adam", "params": {}})
        engine, returned, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        inner = engine.optimizer.optimizer
        out[f"config-{stage}-{offload}"] = (
            type(returned).__name__, type(inner).__name__, inner.adam_w_mode, returned is inner
        )  # fmt: skip
    return out


def test_stage0_hands_back_the_torch_optimizer_and_the_config_builds_deepspeeds_adam(pool2):
    seed = int(torch.randint(0, 2**31, ()))
    results = pool2.run(returned_optimizer_job, seed)
    reference = _net(seed).double()
    adam = torch.optim.Adam(reference.parameters(), lr=LR)
    for x, y in _batches(seed, 2):
        adam.zero_grad()
        torch.nn.functional.mse_loss(reference(x.double()), y.double()).backward()
        adam.step()
    for result in results:
        assert result["client"] == (True, "Adam", True)
        for key in ("params", "params_direct"):
            for ours, theirs in zip(result[key], reference.parameters()):
                torch.testing.assert_close(ours.double(), theirs.detach(), rtol=1e-5, atol=1e-6)
        assert result["callable"] == ("AdamW", True)
        assert result["config-0-False"] == ("FusedAdam", "FusedAdam", True, True)
        # Stages 1-3 hand back the ZeRO wrapper (DeepSpeedZeroOptimizer), as DeepSpeed does.
        assert result["config-2-False"] == ("ZeroPartitionedOptimizer", "FusedAdam", True, False)
        assert result["config-2-True"] == (
            "ZeroPartitionedOptimizer", "DeepSpeedCPUAdam", True, False
        )  # fmt: skip


def resume_across_adam_classes_job(seed: int, folder: str) -> float:
    """Trains with offload (DeepSpeedCPUAdam), saves, resumes without (FusedAdam) and takes one
    more step on both: the largest difference of the parameters."""
    import deepspeed_cpp as deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    part = slice(rank * MICRO, (rank + 1) * MICRO)
    batches = _batches(seed, world)
    engines = []
    for offload in (True, False):
        zero = {"stage": 2}
        if offload:
            zero["offload_optimizer"] = {"device": "cpu"}
        config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero,
                  "optimizer": {"type": "AdamW", "params": {"lr": LR}}}  # fmt: skip
        model = _net(seed + len(engines))  # the resumed one starts from other weights
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        engines.append(engine)
    saved, resumed = engines
    assert type(saved.optimizer.optimizer).__name__ == "DeepSpeedCPUAdam"
    assert type(resumed.optimizer.optimizer).__name__ == "FusedAdam"
    for x, y in batches[:2]:
        saved.backward(torch.nn.functional.mse_loss(saved(x[part]), y[part]))
        saved.step()
    saved.save_checkpoint(folder, tag="t")
    resumed.load_checkpoint(folder, tag="t")
    x, y = batches[2]
    for engine in engines:
        engine.backward(torch.nn.functional.mse_loss(engine(x[part]), y[part]))
        engine.step()
    pairs = zip(saved.module.parameters(), resumed.module.parameters())
    return max(float((a - b).abs().max()) for a, b in pairs)


def test_checkpoint_of_deepspeed_cpu_adam_resumes_in_fused_adam(pool2, tmp_path):
    """Checkpoints written while the config's Adam was DeepSpeedCPUAdam (before it became
    FusedAdam, DeepSpeed's class) resume with their Adam state: both step in cpu_adam, so the
    step after resuming is bit for bit the one the saving engine takes."""
    seed = int(torch.randint(0, 2**31, ()))
    assert pool2.run(resume_across_adam_classes_job, seed, str(tmp_path)) == [0.0, 0.0]
