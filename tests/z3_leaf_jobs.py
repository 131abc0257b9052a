"""Jobs for test_z3_leaf_modules.py on a 2-process gloo pool: a Mixture-of-Experts block whose
ranks run different experts trains at ZeRO-3 once marked as a leaf module."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

HIDDEN, EXPERTS, MICRO_BATCH = 6, 3, 4


class Experts(torch.nn.Module):
    """Each sample goes to the expert its route names; only experts with samples run, so which
    expert modules run depends on the batch (and differs between ranks)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList(
            [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS)]
        )

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            chosen = route == index
            if chosen.any():
                out = out.index_put((chosen.nonzero(as_tuple=True)[0],), expert(x[chosen]))
        return out


class MoeNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(HIDDEN, HIDDEN)
        self.moe = Experts()
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, route):
        return self.head(torch.tanh(self.moe(torch.tanh(self.embed(x)), route)))


def _route(rank: int) -> torch.Tensor:
    # Rank 0 uses expert 0 only; rank 1 experts 1 and 0; expert 2 never runs.
    return torch.tensor([0, 0, 0, 0]) if rank == 0 else torch.tensor([1, 0, 1, 1])


def leaf_block_trains(mark_by: str) -> dict:
    """Marks ``Experts`` (by class or by name), trains two steps at ZeRO-3 and compares the
    reduced gradients with one process running both ranks' batches."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.utils import (
        get_z3_leaf_modules,
        safe_get_full_grad,
        set_z3_leaf_modules,
        z3_leaf_parameter,
    )

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MoeNet()
    reference = copy.deepcopy(model)
    if mark_by == "config":  # zero_optimization.leaf_module marks it as the engine is built
        assert get_z3_leaf_modules(model) == []
    else:
        marked = set_z3_leaf_modules(model, [Experts if mark_by == "class" else "Experts"])
        assert marked == [model.moe] and get_z3_leaf_modules(model) == [model.moe]
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        # A unit per module besides the leaf (small modules would join their parent's).
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_unit_min_numel": 0,
        },
    }
    if mark_by == "config":
        # By qualified class name (a string, as DeepSpeed coerces it) and by a name suffix that
        # matches the same module once more: marked once.
        config["zero_optimization"]["leaf_module"] = {
            "classes": f"{Experts.__module__}.{Experts.__qualname__}",
            "name_suffixes": ["moe"],
        }
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    assert get_z3_leaf_modules(model) == [model.moe]
    coordinator = engine._zero_stage.coordinator
    expert_params = {id(p) for p in model.moe.parameters()}
    leaf_units = [u for u in coordinator.units if expert_params & {id(p) for p in u}]
    assert len(leaf_units) == 1 and {id(p) for p in leaf_units[0]} == expert_params
    assert all(z3_leaf_parameter(p) for p in model.moe.parameters())
    assert not z3_leaf_parameter(model.embed.weight)
    generator = torch.Generator().manual_seed(3)
    ref_params = dict(reference.named_parameters())
    compared = 0
    for _ in range(2):
        x = torch.randn(world * MICRO_BATCH, HIDDEN, generator=generator)
        y = torch.randn(world * MICRO_BATCH, 1, generator=generator)
        mine = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
        loss = torch.nn.functional.mse_loss(engine(x[mine], _route(rank)), y[mine])
        engine.backward(loss)
        reference.zero_grad()
        for r in range(world):
            part = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
            out = reference(x[part], _route(r))
            (torch.nn.functional.mse_loss(out, y[part]) / world).backward()
        for name, param in engine.module.named_parameters():
            expected = ref_params[name].grad
            expected = torch.zeros_like(ref_params[name]) if expected is None else expected
            torch.testing.assert_close(safe_get_full_grad(param), expected, rtol=1e-5, atol=1e-6)
            compared += 1
        engine.step()
        from deepspeed_cpp.utils import safe_get_full_fp32_param

        with torch.no_grad():  # the reference follows the engine's weights
            for name, param in engine.module.named_parameters():
                ref_params[name].copy_(safe_get_full_fp32_param(param))
    engine.destroy()
    assert not z3_leaf_parameter(model.moe.experts[0].weight)
    return {"compared": compared, "units": len(coordinator.units)}
