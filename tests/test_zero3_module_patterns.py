"""ZeRO-3 with module patterns real models use, each training equal to ZeRO-2 (2 real gloo
processes): a module that reads a parameter it does not own (``nn.MultiheadAttention`` uses
``out_proj.weight`` without calling ``out_proj``: the read gathers it and the module keeps it in
its fetch list from then on), and activation checkpointing (a block's forward run again inside the
backward, reentrant or not)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

WIDTH, HEADS, SEQ, MICRO = 32, 4, 5, 2


class AttentionNet(torch.nn.Module):
    def __init__(self, checkpointing: str = "none"):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Tanh(), torch.nn.Linear(2 * WIDTH, WIDTH)
        )
        self.head = torch.nn.Linear(WIDTH, 3)
        self.checkpointing = checkpointing

    def forward(self, x):
        h, _ = self.attn(x, x, x)
        if self.checkpointing == "none":
            h = h + self.mlp(h)
        else:
            reentrant = self.checkpointing == "reentrant"
            h = h + torch.utils.checkpoint.checkpoint(self.mlp, h, use_reentrant=reentrant)
        return self.head(torch.tanh(h))


def _train_a_unit_per_module(model: torch.nn.Module, stage: int, seed: int, steps: int):
    """Trains ``model`` at ``stage`` on 2 ranks' slices of one random batch per step; returns
    the engine and the full state dict after the steps."""
    import deepspeed_cpp as deepspeed

    rank, world = dist.get_rank(), dist.get_world_size()
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}},
        # A unit per module (small ones would join their parent's: out_proj the attention's).
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            **({"stage3_unit_min_numel": 0} if stage == 3 else {}),
        },
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    generator = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        x = torch.randn(MICRO * world, SEQ, WIDTH, generator=generator)
        engine.backward(engine(x[rank * MICRO : (rank + 1) * MICRO]).square().mean())
        engine.step()
    return engine, {k: v.clone() for k, v in engine.full_module_state_dict().items()}


def train_job(stage: int, seed: int, steps: int, checkpointing: str = "none"):

    torch.manual_seed(seed)
    model = AttentionNet(checkpointing)
    engine, result = _train_a_unit_per_module(model, stage, seed, steps)
    if stage == 3:
        coordinator = engine._zero_stage.coordinator
        names = coordinator.unit_names
        result["attn_units"] = sorted(names[u] for u in coordinator._module_units[id(model.attn)])
        result["recording"] = bool(coordinator.schedule.recording())
        result["divergences"] = int(coordinator.schedule.divergences())
    engine.destroy()
    return result


def test_multihead_attention_at_stage3_equals_stage2(pool2):
    seed = int(torch.randint(0, 2**30, ()).item())
    zero2 = pool2.run(train_job, 2, seed, 4)
    zero3 = pool2.run(train_job, 3, seed, 4)
    for rank in range(2):
        assert zero3[rank]["attn_units"] == ["attn", "attn.out_proj"]
        # The borrowed unit is part of the replayed trace: no divergence after the first pass.
        assert zero3[rank]["recording"] is False and zero3[rank]["divergences"] == 0
        for name, expected in zero2[rank].items():
            got = zero3[rank][name]
            assert got.shape == expected.shape, name
            scale = expected.abs().max().item()
            assert (got - expected).abs().max().item() <= 1e-6 * scale, name


@pytest.mark.parametrize("checkpointing", ["reentrant", "non_reentrant"])
def test_activation_checkpointing_at_stage3_equals_stage2(pool2, checkpointing):
    seed = int(torch.randint(0, 2**30, ()).item())
    zero2 = pool2.run(train_job, 2, seed, 3, checkpointing)
    zero3 = pool2.run(train_job, 3, seed, 3, checkpointing)
    for rank in range(2):
        for name, expected in zero2[rank].items():
            got = zero3[rank][name]
            scale = expected.abs().max().item()
            assert (got - expected).abs().max().item() <= 1e-6 * scale, name


class ReturnsItsBias(torch.nn.Linear):
    """Returns its bias for the caller to add after this forward ended (a "dangling" parameter:
    DeepSpeed's test_zero_context_return pattern, Megatron's return-bias linears)."""

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), self.bias


class PassesBiasOn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = ReturnsItsBias(WIDTH, WIDTH)

    def forward(self, x):
        out, bias = self.inner(x)
        return torch.tanh(out), bias  # passed on, still unused


class DanglingNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = PassesBiasOn()
        self.head = torch.nn.Linear(WIDTH, 3)

    def forward(self, x):
        h, bias = self.block(x)
        return self.head(h + bias)


def dangling_job(stage: int, seed: int, steps: int):
    """Trains DanglingNet; at ZeRO-3 also reports where the returned bias got registered."""

    torch.manual_seed(seed)
    model = DanglingNet()
    engine, result = _train_a_unit_per_module(model, stage, seed, steps)
    if stage == 3:
        bias = model.block.inner.bias
        result["registered_on"] = [
            name for name, m in model.named_modules() if id(bias) in m._external_params
        ]
        result["divergences"] = int(engine._zero_stage.coordinator.schedule.divergences())
    engine.destroy()
    return result


def test_returned_parameter_is_kept_for_the_caller(pool2):
    """A parameter a submodule returns is registered on the module that uses it (DeepSpeed's
    ``_external_params`` registry, moved up as it is passed on) and held for it: ZeRO-3 with a
    unit per module trains as ZeRO-2 does."""
    seed = int(torch.randint(0, 2**30, ()).item())
    zero2 = pool2.run(dangling_job, 2, seed, 3)
    zero3 = pool2.run(dangling_job, 3, seed, 3)
    for rank in range(2):
        assert zero3[rank].pop("registered_on") == [""]  # the root adds it
        assert zero3[rank].pop("divergences") == 0
        for name, expected in zero2[rank].items():
            got = zero3[rank][name]
            scale = expected.abs().max().item()
            assert (got - expected).abs().max().item() <= 1e-6 * scale, name


def test_external_parameter_registry_is_deepspeeds():
    from deepspeed_cpp import zero

    owner, user = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    zero.register_external_parameter(user, owner.weight)
    assert user._external_params == {id(owner.weight): owner.weight}
    zero.unregister_external_parameter(user, owner.weight)
    assert user._external_params == {}
    with pytest.raises(RuntimeError, match="not a registered external parameter of Linear"):
        zero.unregister_external_parameter(user, owner.weight)
    with pytest.raises((RuntimeError, TypeError), match="torch.nn.Parameter"):
        zero.register_external_parameter(user, torch.zeros(2))
