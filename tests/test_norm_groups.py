"""``optimizer._get_norm_groups()`` (DeepSpeed's, read by scripts that debug clipping) and
``optimizer._global_grad_norm`` on real 2-rank ZeRO-1 and ZeRO-3 engines with two param groups:
between backward and step, each entry is the norm of its group's reduced gradient (the
float64 reference: the mean over the ranks of each rank's gradient); after this rank halves its
local part of every gradient with ``safe_set_local_grad`` the entries halve, and the step's
global norm is the norm of the halved gradients. The ZeRO-2 case offloads the optimizer to the
CPU and accumulates 4 micro-steps: the norm is that of all four micro-steps' mean gradient (what
DeepSpeed's regression test for its offload buffer ``accumulated_grads_in_cpu`` checks)."""

from __future__ import annotations

import pytest
import torch


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 4))


def _norm_groups_job(stage: int, offload: bool, seed: int, batches):
    import torch.distributed as dist

    import deepspeed_cpp
    from deepspeed_cpp.utils import safe_get_local_grad, safe_set_local_grad

    model = _model(seed)
    groups = [
        {"params": list(model[0].parameters())},
        {"params": list(model[2].parameters()), "weight_decay": 0.1},
    ]
    config = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": len(batches[0]),
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, optimizer, _, _ = deepspeed_cpp.initialize(
        model=model, model_parameters=groups, config=config
    )
    for index, (x, y) in enumerate(batches[dist.get_rank()]):
        if index:
            engine.step()  # a micro-step: no optimizer step before the last backward
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    before = [n.item() for n in optimizer._get_norm_groups()]
    for param in engine.module.parameters():
        safe_set_local_grad(param, safe_get_local_grad(param) * 0.5)
    after = [n.item() for n in optimizer._get_norm_groups()]
    engine.step()
    return before, after, optimizer._global_grad_norm


@pytest.mark.parametrize("stage, offload, gas", [(1, False, 1), (3, False, 1), (2, True, 4)])
def test_norm_groups_before_and_after_editing_gradients(pool2, stage, offload, gas):
    seed = int(torch.randint(0, 2**30, (1,)))
    batches = [[(torch.randn(3, 6), torch.randn(3, 4)) for _ in range(gas)] for _ in range(2)]
    reference = _model(seed).double()
    for x, y in (batch for rank in batches for batch in rank):
        torch.nn.functional.mse_loss(reference(x.double()), y.double()).backward()
    grads = [p.grad / (2 * gas) for p in reference.parameters()]  # mean over ranks, micro-steps
    expected = [torch.cat([g.reshape(-1) for g in grads[i : i + 2]]).norm().item() for i in (0, 2)]
    for before, after, global_norm in pool2.run(_norm_groups_job, stage, offload, seed, batches):
        assert before == pytest.approx(expected, rel=1e-5)
        assert after == pytest.approx([e / 2 for e in expected], rel=1e-5)
        whole = sum(e * e for e in expected) ** 0.5 / 2
        assert global_norm == pytest.approx(whole, rel=1e-5)
