"""Jobs run on every rank of a gloo pool by tests/test_moe_expert_parallel.py: checkpoints of a
dense + MoE model whose 4 experts are split over expert-parallel ranks, saved and loaded at
several world sizes and ep_sizes."""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from moe_parallel_jobs import HIDDEN, make_expert
from torch import nn


class _Net(nn.Module):
    def __init__(self, ep_size: int, num_experts: int):
        from deepspeed_cpp.moe.layer import MoE

        super().__init__()
        self.inp = nn.Linear(7, HIDDEN)
        self.moe = MoE(HIDDEN, make_expert(), num_experts=num_experts, ep_size=ep_size, k=2,
                       min_capacity=2)  # fmt: skip
        self.out = nn.Linear(HIDDEN, 3)

    def forward(self, x):
        hidden, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(hidden), l_aux


def _engine(ep_size: int, stage: int, seed: int, num_experts: int = 4, offload: dict | None = None):
    """An engine over ``_Net`` whose every parameter, expert ones by their global name, starts
    from values that depend on ``seed`` and that name only (the same on any layout)."""
    import deepspeed_cpp
    from deepspeed_cpp.moe.expert_names import expert_layers, global_name
    from deepspeed_cpp.moe.utils import split_params_into_different_moe_groups_for_optimizer

    model = _Net(ep_size, num_experts)
    layers = expert_layers(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            key = zlib.crc32(global_name(name, layers).encode()) + seed
            param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(key)))
            param.mul_(0.3)
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"params": list(model.parameters()), "name": "parameters"}
    )
    config = {
        "gradient_clipping": 0.0,
        "train_batch_size": 6 * dist.get_world_size(),
        "train_micro_batch_size_per_gpu": 6,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 500},
        # eps 1e-4: elements whose gradient cancels to ~0 must not turn rounding into steps
        # (the continuation after resharding sums in another order).
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.01, "eps": 1e-4, "torch_adam": True},
        },
    }
    if offload is not None:
        config["zero_optimization"]["offload_optimizer"] = offload
    engine, *_ = deepspeed_cpp.initialize(model=model, model_parameters=groups, config=config)
    return engine


def _train(engine, steps: range, seed: int) -> None:
    rank = dist.get_rank()
    for step in steps:
        generator = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
        x = torch.randn(6, 7, generator=generator)
        y = torch.randint(0, 3, (6,), generator=generator)
        torch.manual_seed(seed + 7 * step + rank)  # the gate's draws
        logits, l_aux = engine(x)
        engine.backward(nn.functional.cross_entropy(logits, y) + 0.01 * l_aux)
        engine.step()


def _whole(engine) -> dict:
    """Every parameter of the model, every expert under its global name (collective)."""
    return {k: v.clone() for k, v in engine.full_module_state_dict(rank0_only=False).items()}


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _all_equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def save_then_resume(directory: str, stage: int, seed: int, offload: dict | None = None) -> dict:
    """ep_size 2 on this world: trains 2 steps, saves (also save_16bit_model), trains 2 more;
    a second engine from other weights loads the checkpoint and trains the same 2 steps (both
    engines with ``offload`` as their ``offload_optimizer`` section when given)."""
    engine = _engine(2, stage, seed, offload=offload)
    _train(engine, range(2), seed)
    engine.save_checkpoint(directory, tag="t")
    engine.save_16bit_model(directory, "model16.bin")
    saved = _whole(engine)
    _train(engine, range(2, 4), seed)
    uninterrupted = _whole(engine)
    resumed = _engine(2, stage, seed + 1, offload=offload)
    before_load = _whole(resumed)
    resumed.load_checkpoint(directory, tag="t")
    loaded = _whole(resumed)
    _train(resumed, range(2, 4), seed)
    continued = _whole(resumed)
    return {
        "saved": saved if dist.get_rank() == 0 else None,
        "uninterrupted": uninterrupted if dist.get_rank() == 0 else None,
        "loaded_equal": _all_equal(loaded, saved),
        "differed_before_load": _max_diff(before_load, saved),
        "resumed_equal": _all_equal(continued, uninterrupted),
        "trained_after_save": _max_diff(uninterrupted, saved),
        "steps": resumed.global_steps,
    }


def load_elsewhere(directory: str, ep_size: int, stage: int, seed: int, resave: str) -> dict:
    """Loads the ep_size-2 checkpoint into an engine of ``ep_size`` on this world (another
    layout), saves it again to ``resave`` and, on 2 ranks (the saving run's batches), trains
    the 2 steps the saving run trained after its save."""
    engine = _engine(ep_size, stage, seed + 2)
    engine.load_checkpoint(directory, tag="t")
    loaded = _whole(engine)
    engine.save_checkpoint(resave, tag="r")
    result = {"loaded": loaded if dist.get_rank() == 0 else None}
    if dist.get_world_size() == 2:
        _train(engine, range(2, 4), seed)
        result["continued"] = _whole(engine) if dist.get_rank() == 0 else None
    return result


def load_other_num_experts(directory: str) -> str:
    """The error of loading the 4-expert checkpoint into a 2-expert model."""
    engine = _engine(2, 2, 0, num_experts=2)
    try:
        engine.load_checkpoint(directory, tag="t")
    except Exception as error:  # noqa: BLE001 - the message is what the test checks
        return f"{type(error).__name__}: {error}"
    return "no error"
