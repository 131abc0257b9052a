"""The monitor tests' training run and curve check (``test_monitor.py``,
``test_monitor_wandb.py``): a small model trained for ``STEPS`` optimizer steps of ``GAS``
micro-batches on the pool's ranks with the monitor sections given, and the points a back-end
wrote compared with the engine's own."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

STEPS, GAS, MICRO = 4, 2, 3


def train_with_monitors(root: str, stage: int, fp16: bool, monitors: dict | None = None):
    """STEPS optimizer steps of a small model; ``monitors`` replaces the default tensorboard and
    csv_monitor sections (written under ``root/rank<r>``)."""
    import deepspeed_cpp as deepspeed

    rank = dist.get_rank()
    out = os.path.join(root, f"rank{rank}")  # per rank, to see that only rank 0 writes
    if monitors is None:
        monitors = {
            "tensorboard": {"enabled": True, "output_path": out, "job_name": "tb_job"},
            "csv_monitor": {"enabled": True, "output_path": out, "job_name": "csv_job"},
        }
    config = {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": GAS,
        "steps_per_print": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 3},
        },
        "zero_optimization": {"stage": stage},
        **monitors,
    }
    if fp16:
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
    engine, _, _, scheduler = deepspeed.initialize(model=model, config=config)
    dtype = next(engine.module.parameters()).dtype
    generator = torch.Generator().manual_seed(1 + rank)
    losses, lrs, scales = [], [], []
    for _ in range(STEPS):
        step_loss = 0.0
        for _ in range(GAS):
            x = torch.randn(MICRO, 5, generator=generator).to(dtype)
            loss = engine(x).float().pow(2).mean()
            engine.backward(loss)
            engine.step()
            step_loss += loss.item() / GAS
        losses.append(step_loss)
        lrs.append(scheduler.get_last_lr()[0])
        scales.append(engine.get_loss_scale())
    engine.destroy()
    return losses, lrs, scales, engine.train_batch_size()


def assert_points(got, expected, rel):
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert [value for _, value in got] == pytest.approx([v for _, v in expected], rel=rel)
