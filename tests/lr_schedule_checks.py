"""Helpers of the LR schedule tests (``test_lr_schedules.py``, ``test_lr_schedule_use.py``):
tolerance, random arguments, a small optimizer of several parameter groups, and the schedules'
closed forms written here (DeepSpeed's formulas)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch


def assert_lrs_close(actual, expected):
    """Equal to the closed form up to float64 rounding."""
    assert actual == pytest.approx(expected, rel=1e-12, abs=1e-18)


def random_int(low, high):
    return int(torch.randint(low, high + 1, ()).item())


def random_lrs(n, low=1e-4, high=1e-1):
    return [low + (high - low) * float(v) for v in torch.rand(n)]


def make_optimizer(num_groups=3, cls=torch.optim.AdamW, **kwargs):
    """``cls`` over ``num_groups`` parameter groups of one random parameter each, lr 0.5."""
    groups = [{"params": [torch.nn.Parameter(torch.randn(5))]} for _ in range(num_groups)]
    return cls(groups, **{"lr": 0.5, **kwargs})


def group_lrs(optimizer):
    return [float(group["lr"]) for group in optimizer.param_groups]


# ---- closed-form references ------------------------------------------------------------------


def warmup_lr_reference(i, lo, hi, num_steps, kind):
    n = max(2, num_steps)
    if i < 0:
        return lo
    if i >= n:
        return hi
    fraction = math.log(i + 1) / math.log(n) if kind == "log" else i / n
    return lo + (hi - lo) * fraction


def warmup_decay_reference(i, lo, hi, num_steps, total, kind):
    n = max(2, num_steps)
    if i < n:
        return warmup_lr_reference(i, lo, hi, num_steps, kind)
    return lo + (hi - lo) * max(0.0, (total - i) / max(1, total - n))


def warmup_cosine_reference(i, base, total, min_ratio, num_steps, cos_min, kind):
    n = max(2, num_steps)
    if i < 0:
        return 0.0
    if i < n:
        return base * warmup_lr_reference(i, min_ratio, 1.0, num_steps, kind)
    progress = min(1.0, (i - n + 1) / max(1, total - n))
    return base * (cos_min + (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * progress)))


def one_cycle_height(i, first, second, first_stairs, second_stairs):
    """DeepSpeed's float form of the triangle, stairs computed exactly with fractions."""
    b = i + 1
    total = first + second
    x = 1 + b / total - math.floor(1 + b / total)
    ratio = first / total
    rising = x <= ratio
    height = x / ratio if rising else (x - 1) / (ratio - 1)
    stairs = first_stairs if rising else second_stairs
    if stairs > 0:
        offset = b % total
        exact = Fraction(offset, first) if rising else Fraction(total - offset, second)
        height = math.floor(exact * stairs) / stairs
    return height
