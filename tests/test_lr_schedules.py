"""LR schedules against closed-form formulas (lr_schedule_checks.py), step by step, every parameter
group (state dicts, real optimizers, the factory and bad arguments: test_lr_schedule_use.py)."""

import logging
import math

import pytest
import torch
from lr_schedule_checks import (
    assert_lrs_close,
    group_lrs,
    make_optimizer,
    one_cycle_height,
    random_int,
    random_lrs,
    warmup_cosine_reference,
    warmup_decay_reference,
    warmup_lr_reference,
)

from deepspeed_cpp.runtime.lr_schedules import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)

# ---- WarmupLR / WarmupDecayLR ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_every_step_and_group(kind):
    num_steps = random_int(5, 40) | 1
    optimizer = make_optimizer()
    lo, hi = random_lrs(3, 0, 1e-3), random_lrs(3, 1e-2, 1e-1)
    scheduler = WarmupLR(optimizer, lo, hi, num_steps, kind)
    for g, lr in enumerate(group_lrs(optimizer)):
        assert_lrs_close(lr, lo[g])
    for i in range(num_steps + 7):
        scheduler.step()
        assert scheduler.last_batch_iteration == i
        for g in range(3):
            expected = warmup_lr_reference(i, lo[g], hi[g], num_steps, kind)
            assert_lrs_close(optimizer.param_groups[g]["lr"], expected)
            assert_lrs_close(scheduler.get_last_lr()[g], expected)
            assert_lrs_close(scheduler.get_lr()[g], expected)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_boundaries(kind):
    optimizer = make_optimizer(1)
    scheduler = WarmupLR(optimizer, 0.01, 0.11, 10, kind)
    expected = {
        0: 0.01,  # log(1) = 0 and 0/10 = 0: batch 0 still runs at the minimum
        1: 0.01 + 0.1 * (math.log(2) / math.log(10) if kind == "log" else 0.1),
        9: 0.11 if kind == "log" else 0.01 + 0.1 * 0.9,  # log(10)/log(10) = 1
        10: 0.11,
        11: 0.11,
        500: 0.11,
    }
    for i, lr in expected.items():
        scheduler.step(i)
        assert_lrs_close(optimizer.param_groups[0]["lr"], lr)


def test_warmup_lr_max_defaults_to_each_groups_optimizer_lr():
    lrs = random_lrs(2)
    groups = [{"params": [torch.nn.Parameter(torch.randn(2))], "lr": lr} for lr in lrs]
    optimizer = torch.optim.SGD(groups, lr=1.0)
    scheduler = WarmupLR(optimizer, warmup_num_steps=4, warmup_type="linear")
    assert group_lrs(optimizer) == [0.0, 0.0]
    scheduler.step(4)
    assert_lrs_close(group_lrs(optimizer), lrs)


def test_warmup_num_steps_one_is_raised_to_two_as_in_deepspeed():
    optimizer = make_optimizer(1)
    scheduler = WarmupLR(optimizer, 0.0, 1.0, warmup_num_steps=1, warmup_type="linear")
    scheduler.step()
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.0)
    scheduler.step()
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.5)
    scheduler.step()
    assert_lrs_close(optimizer.param_groups[0]["lr"], 1.0)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_every_step_to_zero_at_total(kind):
    num_steps = random_int(3, 15) | 1
    total = num_steps + random_int(5, 30)
    optimizer = make_optimizer(2)
    lo, hi = random_lrs(2, 0, 1e-3), random_lrs(2, 1e-2, 1e-1)
    scheduler = WarmupDecayLR(optimizer, total, lo, hi, num_steps, kind)
    assert_lrs_close(group_lrs(optimizer), lo)
    for i in range(total + 6):
        scheduler.step()
        for g in range(2):
            expected = warmup_decay_reference(i, lo[g], hi[g], num_steps, total, kind)
            assert_lrs_close(optimizer.param_groups[g]["lr"], expected)
    scheduler.step(num_steps)
    assert_lrs_close(group_lrs(optimizer), hi)
    for i in (total, total + 1, 10 * total):
        scheduler.step(i)
        assert_lrs_close(group_lrs(optimizer), lo)


def test_warmup_decay_lr_midpoint_of_decay():
    optimizer = make_optimizer(1)
    scheduler = WarmupDecayLR(optimizer, 30, 0.0, 0.2, 10, "linear")
    scheduler.step(20)
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.1)


# ---- WarmupCosineLR --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_every_step(kind):
    num_steps = random_int(3, 15) | 1
    total = num_steps + random_int(5, 40)
    min_ratio, cos_min = float(torch.rand(())) * 0.5, float(torch.rand(())) * 0.2
    bases = random_lrs(3)
    groups = [{"params": [torch.nn.Parameter(torch.randn(3))], "lr": lr} for lr in bases]
    optimizer = torch.optim.AdamW(groups)
    scheduler = WarmupCosineLR(optimizer, total, min_ratio, num_steps, cos_min, kind)
    assert group_lrs(optimizer) == [0.0, 0.0, 0.0]  # DeepSpeed's value before batch 0
    for i in range(total + 6):
        scheduler.step()
        for g in range(3):
            expected = warmup_cosine_reference(
                i, bases[g], total, min_ratio, num_steps, cos_min, kind
            )
            assert_lrs_close(optimizer.param_groups[g]["lr"], expected)
    scheduler.step(0)
    assert_lrs_close(group_lrs(optimizer), [b * min_ratio for b in bases])
    scheduler.step(num_steps - 1)
    last_warmup = (
        1.0 if kind == "log" else min_ratio + (1 - min_ratio) * (num_steps - 1) / num_steps
    )
    assert_lrs_close(group_lrs(optimizer), [b * last_warmup for b in bases])
    scheduler.step(total - 1)
    assert_lrs_close(group_lrs(optimizer), [b * cos_min for b in bases])


def test_warmup_cosine_lr_boundaries():
    optimizer = make_optimizer(1, lr=2.0)
    scheduler = WarmupCosineLR(optimizer, 110, 0.1, 10, 0.05, "linear")
    expected = {
        0: 2.0 * 0.1,
        5: 2.0 * (0.1 + 0.9 * 0.5),
        9: 2.0 * (0.1 + 0.9 * 0.9),
        # The first decay batch is already one step into the cosine.
        10: 2.0 * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi / 100))),
        59: 2.0 * (0.05 + 0.95 * 0.5),
        109: 2.0 * 0.05,
        110: 2.0 * 0.05,
        1000: 2.0 * 0.05,
    }
    for i, lr in expected.items():
        scheduler.step(i)
        assert_lrs_close(optimizer.param_groups[0]["lr"], lr)


# ---- OneCycle --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "first, second, first_stairs, second_stairs",
    [
        (7, None, 0, None),
        (6, 11, 0, 0),
        (8, 12, 4, 3),
        (9, 5, 3, None),
        (10, 10, -1, -1),
        (22, 23, 22, 23),  # one stair per batch: a float floor would drop some by a stair
    ],
)
def test_one_cycle_lr_and_betas_every_step(first, second, first_stairs, second_stairs):
    optimizer = make_optimizer(2, betas=(0.9, 0.97))
    min_lrs, max_lrs = random_lrs(2, 1e-4, 1e-3), random_lrs(2, 1e-2, 1e-1)
    decay_step, decay_lr_rate, decay_mom_rate = random_int(2, 5), 0.3, 0.01
    scheduler = OneCycle(
        optimizer,
        min_lrs,
        max_lrs,
        decay_lr_rate=decay_lr_rate,
        cycle_first_step_size=first,
        cycle_second_step_size=second,
        cycle_first_stair_count=first_stairs,
        cycle_second_stair_count=second_stairs,
        decay_step_size=decay_step,
        cycle_min_mom=0.85,
        cycle_max_mom=0.95,
        decay_mom_rate=decay_mom_rate,
    )
    second = first if second is None else second
    second_stairs = first_stairs if second_stairs is None else second_stairs
    total = first + second
    assert_lrs_close(group_lrs(optimizer), min_lrs)
    # At construction DeepSpeed writes (cycle_min_mom, 0.99), and 0.99 as the second beta at
    # every step (tests/fixtures/lr_schedules holds DeepSpeed's own values).
    assert [g["betas"] for g in optimizer.param_groups] == [(0.85, 0.99)] * 2
    for i in range(total + 12):
        scheduler.step()
        for g, group in enumerate(optimizer.param_groups):
            if i < total:
                h = one_cycle_height(i, first, second, first_stairs, second_stairs)
                lr = min_lrs[g] + (max_lrs[g] - min_lrs[g]) * h
                mom = 0.95 - (0.95 - 0.85) * h
            else:
                decayed = (i - total + 1) / decay_step
                lr = min_lrs[g] / (1 + decay_lr_rate * decayed)
                mom = 0.95 * (1 + decay_mom_rate * decayed)
            assert_lrs_close(group["lr"], lr)
            assert_lrs_close(group["betas"][0], mom)
            assert group["betas"][1] == 0.99
    # The peak: the last batch of the rising half.
    scheduler.step(first - 1)
    assert_lrs_close(group_lrs(optimizer), max_lrs)
    assert_lrs_close(optimizer.param_groups[0]["betas"][0], 0.85)


def test_one_cycle_stairs_hold_the_lr_flat():
    optimizer = make_optimizer(1)
    scheduler = OneCycle(optimizer, 0.0, 1.0, cycle_first_step_size=6, cycle_first_stair_count=3)
    lrs = []
    for _ in range(12):
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    # batches 1..12: up in stairs of two batches to the peak at 6, then down the same way.
    third = 1 / 3
    assert_lrs_close(
        lrs, [0, third, third, 2 * third, 2 * third, 1, 2 * third, 2 * third, third, third, 0, 0]
    )


def test_one_cycle_without_decay_holds_the_minimum():
    optimizer = make_optimizer(1, betas=(0.9, 0.999))
    scheduler = OneCycle(optimizer, 0.01, 0.1, decay_lr_rate=0.5, cycle_first_step_size=3)
    for _ in range(20):
        scheduler.step()
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.01)
    # decay_step_size 0 holds the momentum at the max; get_mom() gives (beta1, 0.99) pairs.
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    assert scheduler.get_mom() == [(0.9, 0.99)]


def test_one_cycle_leaves_sgd_momentum_alone(caplog):
    # As in DeepSpeed, only an optimizer with "betas" in its defaults gets momentum cycled: an
    # SGD run trains with its own momentum under either library.
    optimizer = make_optimizer(2, cls=torch.optim.SGD, momentum=0.3)
    deepspeed_logger = logging.getLogger("deepspeed_cpp")
    deepspeed_logger.addHandler(caplog.handler)
    try:
        scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=4)
    finally:
        deepspeed_logger.removeHandler(caplog.handler)
    assert "cycle_momentum is off" in caplog.text and "SGD" in caplog.text
    scheduler.step(1)  # batch 2 of 4 on the way up
    assert [g["momentum"] for g in optimizer.param_groups] == [0.3, 0.3]
    assert_lrs_close(group_lrs(optimizer), [0.055, 0.055])
    assert scheduler.get_mom() is None


def test_one_cycle_momentum_off_leaves_momentum_alone():
    optimizer = make_optimizer(1, betas=(0.7, 0.8))
    scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=4, cycle_momentum=False)
    scheduler.step(3)
    assert optimizer.param_groups[0]["betas"] == (0.7, 0.8)
    assert scheduler.get_mom() is None


def test_one_cycle_without_momentum_in_the_optimizer_warns_and_cycles_lr_only(caplog):
    optimizer = make_optimizer(1, cls=torch.optim.Adagrad)
    deepspeed_logger = logging.getLogger("deepspeed_cpp")
    deepspeed_logger.addHandler(caplog.handler)
    try:
        scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=4)
    finally:
        deepspeed_logger.removeHandler(caplog.handler)
    assert "cycle_momentum is off" in caplog.text and "Adagrad" in caplog.text
    scheduler.step(3)
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.1)
    assert "momentum" not in optimizer.param_groups[0]
    assert "betas" not in optimizer.param_groups[0]


# ---- LRRangeTest -----------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_every_step(staircase):
    optimizer = make_optimizer(2)
    min_lrs, step_size, rate = random_lrs(2), random_int(2, 9), float(torch.rand(())) * 3
    scheduler = LRRangeTest(optimizer, min_lrs, step_size, rate, staircase)
    assert_lrs_close(group_lrs(optimizer), min_lrs)
    for i in range(5 * step_size + 3):
        scheduler.step()
        interval = (i + 1) // step_size if staircase else (i + 1) / step_size
        assert_lrs_close(group_lrs(optimizer), [lr * (1 + rate * interval) for lr in min_lrs])
