"""The fp16 scale-growth case (``test_fp16_scale_growth.py`` and
``benchmarks/fp16_scale_growth_vs_deepspeed.py``): a small Tanh MLP trained with plain SGD under
fp16 dynamic loss scaling whose scale doubles every ``WINDOW`` steps, its batches and config, and
the one-process float64 reference under either unscaling rule."""

from __future__ import annotations

import torch

MICRO, IN, HIDDEN, OUT = 4, 6, 10, 3
STEPS, LR, INITIAL_POWER, WINDOW = 5, 0.2, 4, 2
STAGES = (0, 1, 2, 3)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )


def make_batches(seed: int, world: int):
    generator = torch.Generator().manual_seed(seed + 1)
    rows = MICRO * world
    return [
        (torch.randn(rows, IN, generator=generator), torch.randn(rows, OUT, generator=generator))
        for _ in range(STEPS)
    ]


def make_config(stage: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 1000,
        "gradient_clipping": 0.0,  # said out loud: DeepSpeed 0.19.8's default is 1.0, ours 0
        "optimizer": {"type": "SGD", "params": {"lr": LR}},
        "fp16": {
            "enabled": True,
            "initial_scale_power": INITIAL_POWER,
            "loss_scale_window": WINDOW,
            "hysteresis": 1,
        },
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def reference_run(seed: int, world: int, divide_by_new_scale: bool):
    """One process, float64 masters: each rank's fp16 forward/backward on its rows with the loss
    scaled by the scale in force, the ranks' gradients averaged and divided by that scale (or,
    DeepSpeed 0.19.8's order, by the scale after this step's update), then an SGD step."""
    model = make_model(seed).half()
    masters = [p.detach().double() for p in model.parameters()]
    scale = 2.0**INITIAL_POWER
    scales, weights = [], []
    for step, (x, y) in enumerate(make_batches(seed, world)):
        with torch.no_grad():
            for param, master in zip(model.parameters(), masters):
                param.copy_(master)
        grads = [torch.zeros_like(m) for m in masters]
        for rank in range(world):
            rows = slice(rank * MICRO, (rank + 1) * MICRO)
            model.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[rows].half()).float(), y[rows])
            (loss * scale).backward()
            for total, param in zip(grads, model.parameters()):
                assert torch.isfinite(param.grad).all()
                total += param.grad.double() / world
        used = scale
        # DeepSpeed's rule, no overflow so far: after step k > 0 with k % WINDOW == 0 it doubles.
        if step > 0 and step % WINDOW == 0:
            scale *= 2.0
        divisor = scale if divide_by_new_scale else used
        masters = [m - LR * g / divisor for m, g in zip(masters, grads)]
        scales.append(scale)
        weights.append(masters)
    return scales, weights
