"""Jobs run on every rank of a 2-process gloo pool by test_tensor_fragment.py: an engine at a
ZeRO stage reads and edits single parameters' fp32 masters, Adam state and reduced gradients
through deepspeed_cpp.utils, checked against one process training the whole global batch with
torch.optim.AdamW."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

MICRO_BATCH, GAS = 3, 2
IN, HIDDEN, OUT = 7, 13, 5
LR, WEIGHT_DECAY, BETAS, EPS = 1e-2, 0.05, (0.9, 0.99), 1e-6
KEYS = ("exp_avg", "exp_avg_sq")


class SmallNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(IN, HIDDEN)
        self.frozen = torch.nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.second = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = torch.tanh(self.first(x))
        return self.second(torch.tanh(h + self.frozen(h)))


def _config(stage: int, dtype: str, offload: bool, one_bucket: bool = False) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 50}  # several buckets, parameters split
    if one_bucket:  # larger buckets: some parameters lie wholly past rank 0's owned slice
        zero["reduce_bucket_size"] = 100
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = HIDDEN  # biases persist: shared buckets
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "zero_optimization": zero,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _batches(steps: int, world: int):
    generator = torch.Generator().manual_seed(7)
    size = MICRO_BATCH * world
    return [
        [(torch.randn(size, IN, generator=generator), torch.randn(size, OUT, generator=generator))
         for _ in range(GAS)]
        for _ in range(steps)
    ]  # fmt: skip


def _loss(output, target):
    return torch.nn.functional.mse_loss(output.float(), target.float())


def _gather_local(local: torch.Tensor) -> torch.Tensor:
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local.cpu())
    return torch.cat(parts)


def fragments_match_reference(stage: int, dtype: str, offload: bool, one_bucket=False) -> dict:
    """Trains 2 steps of 2 micro-steps; checks grads between backward and step, fp32 masters
    and Adam state after each step, local forms against full ones; then sets a parameter and
    its state on both sides and checks the next step follows. Returns what was checked."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_get_local_grad,
        safe_get_local_optimizer_state,
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
    )
    from deepspeed_cpp.utils.tensor_fragment import GradientNotAvailableError

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = SmallNet()
    reference = copy.deepcopy(model)
    trained = [name for name, p in reference.named_parameters() if p.requires_grad]
    ref_params = dict(reference.named_parameters())
    # The reference's AdamW steps fp32 masters with the engine's reduced gradients (themselves
    # compared with the reference model's): Adam divides by sqrt(v), so a gradient that differs
    # by one rounding, near zero, moves a weight by up to lr; fed the same gradients, masters and
    # state compare tightly, and bf16 gradients are only compared within bf16 precision.
    # bf16: the engine casts the model first, so its masters start from the rounded weights.
    masters = {
        n: ref_params[n].detach().to(_dtype(dtype)).float().requires_grad_(True) for n in trained
    }
    ref_optimizer = torch.optim.AdamW(
        [masters[n] for n in trained], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=model.parameters(),
        config=_config(stage, dtype, offload, one_bucket),
    )
    params = dict(engine.module.named_parameters())
    grad_tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == "fp32" else {"rtol": 0, "atol": 0.05}
    checked = {"grads": 0, "params": 0, "states": 0, "locals": 0}

    def compare_locals(name: str) -> None:
        full = safe_get_full_fp32_param(params[name]).flatten()
        numel = full.numel()
        torch.testing.assert_close(
            _gather_local(safe_get_local_fp32_param(params[name]))[:numel], full.cpu()
        )
        for key in KEYS:
            torch.testing.assert_close(
                _gather_local(safe_get_local_optimizer_state(params[name], key))[:numel],
                safe_get_full_optimizer_state(params[name], key).flatten().cpu(),
            )
        checked["locals"] += 1

    for step, micro_batches in enumerate(_batches(3, world)):
        for micro, (x, y) in enumerate(micro_batches):
            mine = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
            loss = _loss(engine(x[mine].to(_dtype(dtype))), y[mine])
            engine.backward(loss)
            for r in range(world):
                part = slice(r * MICRO_BATCH, (r + 1) * MICRO_BATCH)
                (_loss(reference(x[part]), y[part]) / (world * GAS)).backward()
            if micro < GAS - 1:
                try:
                    safe_get_full_grad(params[trained[0]])
                except GradientNotAvailableError:
                    pass
                else:
                    raise AssertionError("a mid-accumulation gradient was readable")
                engine.step()
                continue
            for name in trained:
                grad = safe_get_full_grad(params[name])
                assert grad.dtype == torch.float32 and grad.shape == ref_params[name].shape
                torch.testing.assert_close(grad.cpu(), ref_params[name].grad, **grad_tolerance)
                local = _gather_local(safe_get_local_grad(params[name]))
                torch.testing.assert_close(local[: grad.numel()], grad.flatten().cpu())
                masters[name].grad = grad.cpu()
                checked["grads"] += 1
            assert safe_get_full_grad(params["frozen.weight"]) is None
            engine.step()
            ref_optimizer.step()
            reference.zero_grad()
        for name in trained:
            torch.testing.assert_close(
                safe_get_full_fp32_param(params[name]).cpu(), masters[name].detach(),
                rtol=1e-6, atol=1e-6,
            )  # fmt: skip
            state = ref_optimizer.state[masters[name]]
            for key in KEYS:
                torch.testing.assert_close(
                    safe_get_full_optimizer_state(params[name], key).cpu(), state[key],
                    rtol=1e-6, atol=1e-9,
                )  # fmt: skip
            compare_locals(name)
            checked["params"] += 1
            checked["states"] += len(KEYS)
        if dtype == "fp32":  # the reference model follows its masters
            with torch.no_grad():
                for name in trained:
                    ref_params[name].copy_(masters[name])
        else:
            with torch.no_grad():
                for name in trained:
                    ref_params[name].copy_(masters[name].to(torch.bfloat16).float())
        if step == 1:
            setters = (safe_set_full_fp32_param, safe_set_full_optimizer_state)
            _set_and_check(params, masters, ref_optimizer, ref_params, setters,
                           safe_get_full_fp32_param, engine, dtype)  # fmt: skip
    engine.destroy()
    return checked


def _set_and_check(params, masters, ref_optimizer, ref_params, setters, get_param, engine, dtype):
    """Sets one weight (and its exp_avg) on both sides; the engine's model must compute with it."""
    set_param, set_state = setters
    name = "first.weight"
    generator = torch.Generator().manual_seed(11)
    value = torch.randn(masters[name].shape, generator=generator)  # the same on every rank
    set_param(params[name], value.to(engine.device))
    set_state(params[name], (value * 0.01).to(engine.device), "exp_avg")
    with torch.no_grad():
        masters[name].copy_(value)
        ref_optimizer.state[masters[name]]["exp_avg"].copy_(value * 0.01)
        ref_params[name].copy_(value if dtype == "fp32" else value.to(torch.bfloat16).float())
    torch.testing.assert_close(get_param(params[name]).cpu(), value, rtol=0, atol=0)
    from deepspeed_cpp.zero import GatheredParameters

    with GatheredParameters([params[name]]):  # the model's own copy follows the master
        torch.testing.assert_close(
            params[name].detach().float().cpu(), value.to(params[name].dtype).float()
        )


def _dtype(dtype: str) -> torch.dtype:
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def errors_are_named(stage: int) -> list[str]:
    """A parameter no engine trains, a key that is no optimizer state, values of the wrong
    shape: each raises an error naming it. Returns the messages."""
    import deepspeed_cpp as deepspeed
    from deepspeed_cpp.utils import (
        safe_get_full_fp32_param,
        safe_get_full_optimizer_state,
        safe_get_local_fp32_param,
        safe_set_full_fp32_param,
        safe_set_local_fp32_param,
    )
    from deepspeed_cpp.utils.tensor_fragment import UnmanagedParameterError

    torch.manual_seed(0)
    model = SmallNet()
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=_config(stage, "fp32", False)
    )
    weight = dict(engine.module.named_parameters())["second.weight"]
    messages = []

    def expect(error_type, call, *args):
        try:
            call(*args)
        except error_type as error:
            messages.append(str(error))
        else:
            raise AssertionError(f"{call.__name__}{args!r} did not raise {error_type.__name__}")

    expect(UnmanagedParameterError, safe_get_full_fp32_param, torch.nn.Parameter(torch.ones(3)))
    expect(ValueError, safe_get_full_optimizer_state, weight, "exp_avg")  # before the first step
    x = torch.randn(MICRO_BATCH, IN)
    for _ in range(GAS):
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    expect(ValueError, safe_get_full_optimizer_state, weight, "momentum_buffer")
    expect(ValueError, safe_get_full_optimizer_state, weight, "step")  # not per-element
    expect(ValueError, safe_set_full_fp32_param, weight, torch.zeros(OUT + 1, HIDDEN))
    local = safe_get_local_fp32_param(weight)
    expect(ValueError, safe_set_local_fp32_param, weight, torch.zeros(local.numel() + 1))
    frozen = dict(engine.module.named_parameters())["frozen.weight"]
    assert safe_get_full_fp32_param(frozen) is None
    expect(UnmanagedParameterError, safe_set_full_fp32_param, frozen, torch.zeros(HIDDEN, HIDDEN))
    engine.destroy()
    expect(UnmanagedParameterError, safe_get_full_fp32_param, weight)  # its engine is gone
    return messages
