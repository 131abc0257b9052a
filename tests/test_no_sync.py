"""``engine.no_sync()`` and ``engine.step()`` after gradients written by hand, on real 2-rank
engines (ZeRO 0, 1, 2) against a float64 torch Adam fed the gradients DeepSpeed's semantics
prescribe (``runtime/no_sync.py``):

- step 1: two backward passes inside ``no_sync()`` (``safe_get_full_grad`` there reads this
  rank's own accumulated gradient), then one outside: the step uses the mean over the ranks of
  all three micro-batches' gradients;
- step 2: one backward inside ``no_sync()``, then ``step()`` straight after the block: the
  engine reduces what the block left before stepping (at ZeRO-0 rank 0 calls DeepSpeed's
  ``engine.allreduce_gradients()`` first, twice: the mean over the ranks, reduced once; inside
  the block it raises);
- step 3: gradients written into ``.grad`` by hand (different on each rank), ``step()`` with no
  backward: they are reduced and stepped with, as DeepSpeed does; a second ``step()`` still
  raises StepWithoutBackwardError;
- ``step()`` and a nested ``no_sync()`` inside the block raise NoSyncError (an AssertionError,
  as DeepSpeed's), ZeRO-2 refuses the block; ``backward`` returns the loss divided by the
  accumulation steps.
An fp16 engine takes hand-written inf gradients as an overflow: the step is skipped, the loss
scale halves."""

from __future__ import annotations

import pytest
import torch

LR, EPS = 1e-2, 1e-6


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def _config(stage: int, fp16: bool = False) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,  # DeepSpeed's default (1.0) would clip; the reference does not
        "optimizer": {"type": "Adam", "params": {"lr": LR, "eps": EPS}},
        "zero_optimization": {"stage": stage},
    }
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return config


def _loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def _no_sync_job(stage: int, seed: int, batches, hand_grads):
    """batches[rank][i]: this rank's micro-batches; hand_grads[rank]: its hand-set gradients."""
    import torch.distributed as dist

    import deepspeed_cpp
    from deepspeed_cpp.runtime.call_order import StepWithoutBackwardError
    from deepspeed_cpp.runtime.no_sync import NoSyncError
    from deepspeed_cpp.utils import safe_get_full_grad

    rank = dist.get_rank()
    mine, out = batches[rank], {"states": [], "errors": {}}
    engine, *_ = deepspeed_cpp.initialize(model=_model(seed), config=_config(stage))
    params = list(engine.module.parameters())
    if stage >= 2:
        try:
            with engine.no_sync():
                pass
        except NoSyncError as error:
            out["errors"]["stage"] = str(error)
    else:
        with engine.no_sync():
            for batch in mine[:2]:
                engine.backward(_loss(engine, batch))
            out["local_grads"] = [safe_get_full_grad(p).clone() for p in params]
            for name, call in (("step", engine.step), ("nested", engine.no_sync().__enter__)):
                try:
                    call()
                except AssertionError as error:
                    out["errors"][name] = (type(error).__name__, str(error))
        engine.backward(_loss(engine, mine[2]))
        engine.step()
        out["states"].append([p.detach().clone() for p in params])
        with engine.no_sync():
            engine.backward(_loss(engine, mine[3]))
            try:
                engine.allreduce_gradients()
            except RuntimeError as error:
                out["errors"]["allreduce"] = str(error)
        # At ZeRO-0 rank 0 calls it, rank 1 steps straight after the block (the engine reduces
        # first): one reduction each, the same collective (at ZeRO-1 safe_get_full_grad is a
        # collective of its own, so there both step straight after the block).
        if stage == 0 and rank == 0:
            engine.allreduce_gradients()  # DeepSpeed's public call: reduces now
            engine.allreduce_gradients()  # nothing owed any more: no second averaging
            out["reduced_grads"] = [safe_get_full_grad(p).clone() for p in params]
        engine.step()
        out["states"].append([p.detach().clone() for p in params])
    for param, grad in zip(params, hand_grads[rank]):
        param.grad = grad.clone()
    engine.step()
    out["states"].append([p.detach().clone() for p in params])
    try:
        engine.step()
    except StepWithoutBackwardError as error:
        out["errors"]["again"] = str(error)
    engine.destroy()
    if stage == 0:  # fp16: hand-written inf gradients are an overflow
        engine, *_ = deepspeed_cpp.initialize(model=_model(seed), config=_config(0, True))
        for param in engine.module.parameters():
            param.grad = torch.full_like(param, float("inf"))
        before = [p.detach().clone() for p in engine.module.parameters()]
        engine.step()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, engine.module.parameters()))
        out["fp16"] = (engine.skipped_steps, engine.get_loss_scale(), unchanged)
        engine.destroy()
        config = dict(_config(0), gradient_accumulation_steps=3)
        engine, *_ = deepspeed_cpp.initialize(model=_model(seed), config=config)
        loss = _loss(engine, mine[0])
        out["returned"] = (engine.backward(loss).item(), loss.item() / 3)
        engine.destroy()
    return out


def _grads(model, batches) -> list[torch.Tensor]:
    model.zero_grad()
    for batch in batches:
        _loss(model, batch).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_no_sync_and_hand_set_gradients_match_reference(pool2, stage):
    seed = int(torch.randint(0, 2**30, (1,)))
    batches = [[(torch.randn(2, 5), torch.randn(2, 3)) for _ in range(4)] for _ in range(2)]
    shapes = [p.shape for p in _model(seed).parameters()]
    hand_grads = [[torch.randn(s) for s in shapes] for _ in range(2)]

    reference = _model(seed).double()
    optimizer = torch.optim.Adam(reference.parameters(), lr=LR, eps=EPS)
    batches64 = [[(x.double(), y.double()) for x, y in rank] for rank in batches]
    expected_local, expected_states = [], []

    def step_with(per_rank: list[list[torch.Tensor]]) -> None:
        for param, *grads in zip(reference.parameters(), *per_rank):
            param.grad = sum(grads) / len(grads)
        optimizer.step()
        expected_states.append([p.detach().clone() for p in reference.parameters()])

    if stage < 2:
        expected_local = [_grads(reference, rank[:2]) for rank in batches64]
        step_with([_grads(reference, rank[:3]) for rank in batches64])
        second = [_grads(reference, rank[3:4]) for rank in batches64]
        step_with(second)
    step_with([[g.double() for g in rank] for rank in hand_grads])

    for rank, out in enumerate(pool2.run(_no_sync_job, stage, seed, batches, hand_grads)):
        errors = out["errors"]
        assert "no engine.backward() since the last engine.step()" in errors["again"], errors
        assert len(out["states"]) == len(expected_states)
        for step, (got, want) in enumerate(zip(out["states"], expected_states)):
            for g, w in zip(got, want):
                message = f"step {step}"
                torch.testing.assert_close(
                    g.double(), w, rtol=1e-5, atol=1e-6, msg=lambda m, s=message: f"{s}: {m}"
                )
        if stage >= 2:
            assert (
                "incompatible with gradient partitioning logic of ZeRO stage 2" in (errors["stage"])
            )
            continue
        for g, w in zip(out["local_grads"], expected_local[rank]):
            torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-7)
        assert errors["step"][0] == "NoSyncError", errors
        assert "It is illegal to call Engine.step() inside no_sync" in errors["step"][1]
        assert "reentry is unsupported" in errors["nested"][1], errors
        assert "inside engine.no_sync()" in errors["allreduce"], errors
        if stage == 0 and rank == 0:  # allreduce_gradients() after the block: the ranks' mean
            for g, *w in zip(out["reduced_grads"], *second):
                torch.testing.assert_close(g.double(), sum(w) / 2, rtol=1e-5, atol=1e-7)
        if stage == 0:
            assert out["fp16"] == (1, 2.0**7, True), out["fp16"]
            assert out["returned"][0] == pytest.approx(out["returned"][1], rel=1e-6)
