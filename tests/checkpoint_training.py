"""What the checkpoint tests train: a small model with odd sizes, a tied weight, a frozen layer
and a buffer, its ds_config per world size and ZeRO stage, seeded global batches, and the
independent reference (one process, torch.optim.AdamW, uninterrupted) that resharded runs must
match; used by test_checkpoint.py and the other checkpoint tests."""

from __future__ import annotations

import torch
import torch.distributed as dist

IN, HIDDEN, OUT = 7, 19, 3
GLOBAL_BATCH = 12
# eps 1e-4, not Adam's 1e-8: a gradient element that nearly cancels (|g| near eps) moves by
# lr * g / (|g| + eps), which turns the float32 rounding of g (the engine's and the reference's
# gradients differ by ~1e-10) into up to lr * 1e-10 / eps: at eps 1e-8 mid.weight was 2.06e-6
# from the reference after the first step (DS_TEST_SEED=2107468766), at 1e-6 still 9.7e-7.
LR, MIN_LR, WARMUP, WEIGHT_DECAY, BETAS, EPS, CLIP = 2e-2, 2e-3, 4, 0.05, (0.9, 0.99), 1e-4, 0.5
# (world size -> gradient accumulation steps): every world trains on GLOBAL_BATCH samples a step.
GAS = {1: 3, 2: 2, 3: 1}


class Net(torch.nn.Module):
    """Odd sizes, a tied weight (two names), a frozen layer, a buffer."""

    def __init__(self, hidden: int = HIDDEN, extra_layer: bool = False):
        super().__init__()
        self.embed = torch.nn.Linear(IN, hidden)
        self.mid = torch.nn.Linear(hidden, hidden)
        self.frozen = torch.nn.Linear(hidden, hidden)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(hidden, OUT)
        self.head2 = torch.nn.Linear(hidden, OUT)
        self.head2.weight = self.head.weight
        self.register_buffer("offset", torch.randn(hidden))
        self.extra = torch.nn.Linear(hidden, hidden) if extra_layer else None

    def forward(self, x):
        # The buffer stays float32 under fp16/bf16 (the engine casts parameters only, as
        # DeepSpeed 0.19.8 does): the model casts it where it meets the activations.
        h = torch.tanh(self.embed(x)) + self.offset.to(x.dtype)
        h = torch.tanh(self.mid(h)) + 0.5 * self.frozen(h)
        if self.extra is not None:
            h = h + self.extra(h)
        return self.head(h) + 0.5 * self.head2(torch.tanh(h))


def make_model(seed: int, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Weights decay, biases do not: two optimizer param groups."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in trainable if not n.endswith("bias")]},
        {"params": [p for n, p in trainable if n.endswith("bias")], "weight_decay": 0.0},
    ]


def lr_at(step: int) -> float:
    """WarmupLR (linear) as DeepSpeed defines it: step k trains with the lr of batch k - 1."""
    if step == 0:
        return MIN_LR
    return MIN_LR + (LR - MIN_LR) * min(1.0, (step - 1) / WARMUP)


def config(world: int, stage: int, dtype: str = "fp32") -> dict:
    gas = GAS[world]
    result = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world * gas),
        "gradient_accumulation_steps": gas,
        "gradient_clipping": CLIP,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_min_lr": MIN_LR,
                "warmup_max_lr": LR,
                "warmup_num_steps": WARMUP,
                "warmup_type": "linear",
            },
        },  # fmt: skip
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 300},
    }
    if dtype == "fp16":
        result["fp16"] = {"enabled": True, "initial_scale_power": 10, "hysteresis": 1}
    if dtype == "bf16":
        result["bf16"] = {"enabled": True}
    return result


def global_batches(seed: int, steps: int):
    generator = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(GLOBAL_BATCH, IN, generator=generator),
         torch.randn(GLOBAL_BATCH, OUT, generator=generator))
        for _ in range(steps)
    ]  # fmt: skip


def build_engine(model_seed: int, world: int, stage: int, dtype: str = "fp32", **model_kwargs):
    import deepspeed_cpp as deepspeed

    model = make_model(model_seed, **model_kwargs)
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model), config=config(world, stage, dtype)
    )
    return engine


def train(engine, batches, overflow_at: int | None = None) -> None:
    """Trains one optimizer step per global batch; this rank's rows of each micro-batch."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gas = engine.gradient_accumulation_steps()
    micro = GLOBAL_BATCH // (world * gas)
    dtype = next(engine.module.parameters()).dtype
    for x, y in batches:
        for k in range(gas):
            rows = slice((k * world + rank) * micro, (k * world + rank + 1) * micro)
            handle = None
            if overflow_at == engine.global_steps and rank == world - 1:
                handle = engine.module.mid.weight.register_hook(lambda g: g * float("inf"))
            loss = torch.nn.functional.mse_loss(engine(x[rows].to(dtype)).float(), y[rows])
            engine.backward(loss)
            if handle is not None:
                handle.remove()
            engine.step()


def params_of(engine) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in engine.module.state_dict().items()}


def reference(
    model_seed: int,
    data_seed: int,
    worlds: list[int],
    weights: dict | None = None,
    reverse_ranks: bool = False,
) -> dict[str, torch.Tensor]:
    """The uninterrupted run: one process, torch.optim.AdamW, the same clipping and warm-up.

    Step k is data parallelism over ``worlds[k]`` ranks simulated rank by rank, in the engine's
    order of the floating-point sums: each rank adds up its micro-batches' gradients (each
    micro-batch loss divided by the accumulation steps), then the ranks' sums are added, rank 0
    first, and divided by the world size. The global batch and the mathematics are the same for
    every world size; the order of the sums is the engine's too, except among 3 ranks, where
    gloo's all-reduce adds in an order of its own (see SUM_ORDER_TOLERANCE). ``weights``: start
    from these instead of the seeded initial weights. ``reverse_ranks``: add the ranks' sums
    last rank first (benchmarks/sum_order_spread.py measures what that order changes).
    """
    model = make_model(model_seed)
    if weights is not None:
        model.load_state_dict(weights)
    optimizer = torch.optim.AdamW(
        param_groups(model), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step, ((x, y), world) in enumerate(zip(global_batches(data_seed, len(worlds)), worlds)):
        gas = GAS[world]
        micro = GLOBAL_BATCH // (world * gas)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        ranks_sums = []
        for rank in range(world):
            own = [torch.zeros_like(p) for p in trainable]
            for k in range(gas):
                rows = slice((k * world + rank) * micro, (k * world + rank + 1) * micro)
                model.zero_grad()
                (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / gas).backward()
                for accumulated, p in zip(own, trainable):
                    accumulated += p.grad
            ranks_sums.append(own)
        if reverse_ranks:
            ranks_sums.reverse()
        total = [torch.zeros_like(p) for p in trainable]
        for own in ranks_sums:
            for accumulated, mine in zip(total, own):
                accumulated += mine
        for accumulated, p in zip(total, trainable):
            p.grad = accumulated / world
        torch.nn.utils.clip_grad_norm_(trainable, CLIP)
        optimizer.step()
    return {n: t.detach() for n, t in model.state_dict().items()}


def max_relative_difference(ours: dict, expected: dict) -> float:
    assert ours.keys() == expected.keys()
    worst = 0.0
    for name, value in expected.items():
        scale = max(value.float().abs().max().item(), 1e-30)
        worst = max(worst, (ours[name].float() - value.float()).abs().max().item() / scale)
    return worst


# Against the one-process reference, relative to each tensor's largest element. The reference
# adds gradients in the engine's order for 1 and 2 ranks, so there our runs stay within 1e-6
# (DS_TEST_SEED=575798662, 2 ranks, 3 steps: 7.8e-8). Among 3 ranks gloo's all-reduce adds in an
# order of its own, and Adam's m / sqrt(v) enlarges that rounding where a gradient nearly
# cancels: `python benchmarks/sum_order_spread.py` (the reference against itself with the 3
# ranks added in reverse, steps on 3, 3, 3, 2, 2 ranks, 4000 seeds) printed > 1e-6 in 8 runs,
# > 1e-5 in 1 (DS_TEST_SEED=575798662's 8.9e-6 was such a tail, before the reference took the
# engine's order), the largest 1.71e-5, none > 3e-5 (all at eps 1e-8: the larger eps above only
# damps that). A step fewer is > 1e-3.
SUM_ORDER_TOLERANCE = 3e-5


def reference_tolerance(worlds) -> float:
    """The tolerance against ``reference(..., worlds)``: 1e-6 unless a step ran on 3 ranks."""
    return SUM_ORDER_TOLERANCE if 3 in worlds else 1e-6


def assert_same(a, b, where: str) -> None:
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def tensors_in(value):
    if torch.is_tensor(value):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item)
