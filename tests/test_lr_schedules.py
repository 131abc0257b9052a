"""LR schedules against closed-form formulas written here, step by step, plus real optimizers."""

import copy
import logging
import math
from fractions import Fraction

import pytest
import torch

from deepspeed_cpp.runtime.lr_schedules import (
    SCHEDULER_NAMES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)


def _close(actual, expected):
    assert actual == pytest.approx(expected, rel=1e-12, abs=1e-18)


def _random_int(low, high):
    return int(torch.randint(low, high + 1, ()).item())


def _random_lrs(n, low=1e-4, high=1e-1):
    return [low + (high - low) * float(v) for v in torch.rand(n)]


def _optimizer(num_groups=3, cls=torch.optim.AdamW, **kwargs):
    groups = [{"params": [torch.nn.Parameter(torch.randn(5))]} for _ in range(num_groups)]
    return cls(groups, **{"lr": 0.5, **kwargs})


def _group_lrs(optimizer):
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


# ---- WarmupLR / WarmupDecayLR ----------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_every_step_and_group(kind):
    num_steps = _random_int(5, 40) | 1
    optimizer = _optimizer()
    lo, hi = _random_lrs(3, 0, 1e-3), _random_lrs(3, 1e-2, 1e-1)
    scheduler = WarmupLR(optimizer, lo, hi, num_steps, kind)
    for g, lr in enumerate(_group_lrs(optimizer)):
        _close(lr, lo[g])
    for i in range(num_steps + 7):
        scheduler.step()
        assert scheduler.last_batch_iteration == i
        for g in range(3):
            expected = warmup_lr_reference(i, lo[g], hi[g], num_steps, kind)
            _close(optimizer.param_groups[g]["lr"], expected)
            _close(scheduler.get_last_lr()[g], expected)
            _close(scheduler.get_lr()[g], expected)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_lr_boundaries(kind):
    optimizer = _optimizer(1)
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
        _close(optimizer.param_groups[0]["lr"], lr)


def test_warmup_lr_max_defaults_to_each_groups_optimizer_lr():
    lrs = _random_lrs(2)
    groups = [{"params": [torch.nn.Parameter(torch.randn(2))], "lr": lr} for lr in lrs]
    optimizer = torch.optim.SGD(groups, lr=1.0)
    scheduler = WarmupLR(optimizer, warmup_num_steps=4, warmup_type="linear")
    assert _group_lrs(optimizer) == [0.0, 0.0]
    scheduler.step(4)
    _close(_group_lrs(optimizer), lrs)


def test_warmup_num_steps_one_is_raised_to_two_as_in_deepspeed():
    optimizer = _optimizer(1)
    scheduler = WarmupLR(optimizer, 0.0, 1.0, warmup_num_steps=1, warmup_type="linear")
    scheduler.step()
    _close(optimizer.param_groups[0]["lr"], 0.0)
    scheduler.step()
    _close(optimizer.param_groups[0]["lr"], 0.5)
    scheduler.step()
    _close(optimizer.param_groups[0]["lr"], 1.0)


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_decay_lr_every_step_to_zero_at_total(kind):
    num_steps = _random_int(3, 15) | 1
    total = num_steps + _random_int(5, 30)
    optimizer = _optimizer(2)
    lo, hi = _random_lrs(2, 0, 1e-3), _random_lrs(2, 1e-2, 1e-1)
    scheduler = WarmupDecayLR(optimizer, total, lo, hi, num_steps, kind)
    _close(_group_lrs(optimizer), lo)
    for i in range(total + 6):
        scheduler.step()
        for g in range(2):
            expected = warmup_decay_reference(i, lo[g], hi[g], num_steps, total, kind)
            _close(optimizer.param_groups[g]["lr"], expected)
    scheduler.step(num_steps)
    _close(_group_lrs(optimizer), hi)
    for i in (total, total + 1, 10 * total):
        scheduler.step(i)
        _close(_group_lrs(optimizer), lo)


def test_warmup_decay_lr_midpoint_of_decay():
    optimizer = _optimizer(1)
    scheduler = WarmupDecayLR(optimizer, 30, 0.0, 0.2, 10, "linear")
    scheduler.step(20)
    _close(optimizer.param_groups[0]["lr"], 0.1)


# ---- WarmupCosineLR --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["log", "linear"])
def test_warmup_cosine_lr_every_step(kind):
    num_steps = _random_int(3, 15) | 1
    total = num_steps + _random_int(5, 40)
    min_ratio, cos_min = float(torch.rand(())) * 0.5, float(torch.rand(())) * 0.2
    bases = _random_lrs(3)
    groups = [{"params": [torch.nn.Parameter(torch.randn(3))], "lr": lr} for lr in bases]
    optimizer = torch.optim.AdamW(groups)
    scheduler = WarmupCosineLR(optimizer, total, min_ratio, num_steps, cos_min, kind)
    assert _group_lrs(optimizer) == [0.0, 0.0, 0.0]  # DeepSpeed's value before batch 0
    for i in range(total + 6):
        scheduler.step()
        for g in range(3):
            expected = warmup_cosine_reference(
                i, bases[g], total, min_ratio, num_steps, cos_min, kind
            )
            _close(optimizer.param_groups[g]["lr"], expected)
    scheduler.step(0)
    _close(_group_lrs(optimizer), [b * min_ratio for b in bases])
    scheduler.step(num_steps - 1)
    last_warmup = (
        1.0 if kind == "log" else min_ratio + (1 - min_ratio) * (num_steps - 1) / num_steps
    )
    _close(_group_lrs(optimizer), [b * last_warmup for b in bases])
    scheduler.step(total - 1)
    _close(_group_lrs(optimizer), [b * cos_min for b in bases])


def test_warmup_cosine_lr_boundaries():
    optimizer = _optimizer(1, lr=2.0)
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
        _close(optimizer.param_groups[0]["lr"], lr)


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
    optimizer = _optimizer(2, betas=(0.9, 0.97))
    min_lrs, max_lrs = _random_lrs(2, 1e-4, 1e-3), _random_lrs(2, 1e-2, 1e-1)
    decay_step, decay_lr_rate, decay_mom_rate = _random_int(2, 5), 0.3, 0.01
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
    _close(_group_lrs(optimizer), min_lrs)
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
            _close(group["lr"], lr)
            _close(group["betas"][0], mom)
            assert group["betas"][1] == 0.99
    # The peak: the last batch of the rising half.
    scheduler.step(first - 1)
    _close(_group_lrs(optimizer), max_lrs)
    _close(optimizer.param_groups[0]["betas"][0], 0.85)


def test_one_cycle_stairs_hold_the_lr_flat():
    optimizer = _optimizer(1)
    scheduler = OneCycle(optimizer, 0.0, 1.0, cycle_first_step_size=6, cycle_first_stair_count=3)
    lrs = []
    for _ in range(12):
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    # batches 1..12: up in stairs of two batches to the peak at 6, then down the same way.
    third = 1 / 3
    _close(
        lrs, [0, third, third, 2 * third, 2 * third, 1, 2 * third, 2 * third, third, third, 0, 0]
    )


def test_one_cycle_without_decay_holds_the_minimum():
    optimizer = _optimizer(1, betas=(0.9, 0.999))
    scheduler = OneCycle(optimizer, 0.01, 0.1, decay_lr_rate=0.5, cycle_first_step_size=3)
    for _ in range(20):
        scheduler.step()
    _close(optimizer.param_groups[0]["lr"], 0.01)
    # decay_step_size 0 holds the momentum at the max; get_mom() gives (beta1, 0.99) pairs.
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    assert scheduler.get_mom() == [(0.9, 0.99)]


def test_one_cycle_leaves_sgd_momentum_alone(caplog):
    # As in DeepSpeed, only an optimizer with "betas" in its defaults gets momentum cycled: an
    # SGD run trains with its own momentum under either library.
    optimizer = _optimizer(2, cls=torch.optim.SGD, momentum=0.3)
    deepspeed_logger = logging.getLogger("deepspeed_cpp")
    deepspeed_logger.addHandler(caplog.handler)
    try:
        scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=4)
    finally:
        deepspeed_logger.removeHandler(caplog.handler)
    assert "cycle_momentum is off" in caplog.text and "SGD" in caplog.text
    scheduler.step(1)  # batch 2 of 4 on the way up
    assert [g["momentum"] for g in optimizer.param_groups] == [0.3, 0.3]
    _close(_group_lrs(optimizer), [0.055, 0.055])
    assert scheduler.get_mom() is None


def test_one_cycle_momentum_off_leaves_momentum_alone():
    optimizer = _optimizer(1, betas=(0.7, 0.8))
    scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=4, cycle_momentum=False)
    scheduler.step(3)
    assert optimizer.param_groups[0]["betas"] == (0.7, 0.8)
    assert scheduler.get_mom() is None


def test_one_cycle_without_momentum_in_the_optimizer_warns_and_cycles_lr_only(caplog):
    optimizer = _optimizer(1, cls=torch.optim.Adagrad)
    deepspeed_logger = logging.getLogger("deepspeed_cpp")
    deepspeed_logger.addHandler(caplog.handler)
    try:
        scheduler = OneCycle(optimizer, 0.01, 0.1, cycle_first_step_size=4)
    finally:
        deepspeed_logger.removeHandler(caplog.handler)
    assert "cycle_momentum is off" in caplog.text and "Adagrad" in caplog.text
    scheduler.step(3)
    _close(optimizer.param_groups[0]["lr"], 0.1)
    assert "momentum" not in optimizer.param_groups[0]
    assert "betas" not in optimizer.param_groups[0]


# ---- LRRangeTest -----------------------------------------------------------------------------


@pytest.mark.parametrize("staircase", [False, True])
def test_lr_range_test_every_step(staircase):
    optimizer = _optimizer(2)
    min_lrs, step_size, rate = _random_lrs(2), _random_int(2, 9), float(torch.rand(())) * 3
    scheduler = LRRangeTest(optimizer, min_lrs, step_size, rate, staircase)
    _close(_group_lrs(optimizer), min_lrs)
    for i in range(5 * step_size + 3):
        scheduler.step()
        interval = (i + 1) // step_size if staircase else (i + 1) / step_size
        _close(_group_lrs(optimizer), [lr * (1 + rate * interval) for lr in min_lrs])


# ---- state dicts, resuming, explicit iterations ----------------------------------------------


SCHEDULES = {
    "WarmupLR": lambda opt: WarmupLR(opt, 0.001, None, 9, "log"),
    "WarmupDecayLR": lambda opt: WarmupDecayLR(opt, 40, [0.0, 0.001], 0.02, 7, "linear"),
    "WarmupCosineLR": lambda opt: WarmupCosineLR(opt, 45, 0.1, 8, 0.01, "log"),
    "OneCycle": lambda opt: OneCycle(opt, 0.001, 0.01, 0.2, 6, 9, 3, 2, 4, True, 0.8, 0.9, 0.1),
    "LRRangeTest": lambda opt: LRRangeTest(opt, 0.001, 5, 0.5, True),
}


@pytest.mark.parametrize("name", SCHEDULES)
def test_state_dict_round_trip_continues_identically(name):
    make = SCHEDULES[name]
    optimizer = _optimizer(2)
    scheduler = make(optimizer)
    for _ in range(_random_int(3, 25)):
        scheduler.step()
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_scheduler = copy.deepcopy(scheduler.state_dict())
    assert saved_scheduler["last_batch_iteration"] == scheduler.last_batch_iteration

    # A resumed run: fresh objects built the same way, then both state dicts loaded.
    resumed_optimizer = _optimizer(2)
    resumed = make(resumed_optimizer)
    resumed_optimizer.load_state_dict(saved_optimizer)
    resumed.load_state_dict(saved_scheduler)
    assert resumed.get_last_lr() == scheduler.get_last_lr()
    for _ in range(30):
        scheduler.step()
        resumed.step()
        assert resumed.get_last_lr() == scheduler.get_last_lr()
        assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
        assert resumed_optimizer.param_groups[1]["betas"] == optimizer.param_groups[1]["betas"]


def test_bases_read_from_the_optimizer_survive_a_scheduler_built_after_loading():
    optimizer = _optimizer(1, lr=0.3)
    scheduler = WarmupCosineLR(optimizer, 30, 0.0, 5, 0.0, "linear")
    for _ in range(12):
        scheduler.step()
    state = scheduler.state_dict()
    late_optimizer = _optimizer(1, lr=0.3)
    late_optimizer.load_state_dict(optimizer.state_dict())  # lr is now mid-cosine
    late = WarmupCosineLR(late_optimizer, 30, 0.0, 5, 0.0, "linear", last_batch_iteration=11)
    late.load_state_dict(state)
    scheduler.step()
    late.step()
    assert late.get_last_lr() == scheduler.get_last_lr()


def test_deepspeed_state_dict_with_only_the_index_loads():
    optimizer = _optimizer(1, lr=0.3)
    scheduler = WarmupCosineLR(optimizer, 30, 0.0, 5, 0.0, "linear")
    scheduler.load_state_dict({"last_batch_iteration": 7})
    scheduler.step()
    _close(optimizer.param_groups[0]["lr"], warmup_cosine_reference(8, 0.3, 30, 0, 5, 0, "linear"))


def test_resuming_constructor_leaves_the_optimizer_alone_until_step():
    optimizer = _optimizer(1, lr=0.123)
    scheduler = WarmupDecayLR(optimizer, 50, 0.0, 0.2, 10, "linear", last_batch_iteration=19)
    assert optimizer.param_groups[0]["lr"] == 0.123
    with pytest.raises(RuntimeError, match="last_batch_iteration=19.*call step\\(\\) first"):
        scheduler.get_last_lr()
    scheduler.step()
    _close(optimizer.param_groups[0]["lr"], warmup_decay_reference(20, 0, 0.2, 10, 50, "linear"))


def test_step_to_an_explicit_iteration():
    optimizer = _optimizer(1)
    scheduler = WarmupLR(optimizer, 0.0, 1.0, 100, "linear")
    scheduler.step(37)
    _close(optimizer.param_groups[0]["lr"], 0.37)
    scheduler.step()
    _close(optimizer.param_groups[0]["lr"], 0.38)
    scheduler.step(-1)
    _close(optimizer.param_groups[0]["lr"], 0.0)


# ---- real optimizers -------------------------------------------------------------------------


def test_sgd_steps_use_the_scheduled_lr():
    weight = torch.nn.Parameter(torch.randn(17, dtype=torch.float64))
    optimizer = torch.optim.SGD([weight], lr=1.0)
    scheduler = WarmupDecayLR(optimizer, 25, 0.01, 0.5, 6, "log")
    for i in range(30):
        before = weight.detach().clone()
        optimizer.zero_grad()
        (weight**2).sum().backward()  # grad = 2 w
        optimizer.step()
        # The optimizer step of batch i runs with the lr written after batch i - 1.
        lr = warmup_decay_reference(i - 1, 0.01, 0.5, 6, 25, "log")
        torch.testing.assert_close(weight.detach(), before - lr * 2 * before, rtol=0, atol=1e-15)
        scheduler.step()


def test_adamw_with_schedule_matches_adamw_given_the_same_lrs_by_hand():
    model = torch.nn.Linear(9, 3)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, betas=(0.9, 0.99))
    scheduler = OneCycle(optimizer, 1e-3, 1e-2, 0.1, 5, 7, decay_step_size=3)
    x, y = torch.randn(4, 9), torch.randn(4, 3)
    lrs_used = set()
    for i in range(20):
        for m, opt in ((model, optimizer), (reference, reference_optimizer)):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
        if i > 0:  # the reference gets the formula's lr and beta1 for batch i - 1 by hand
            if i - 1 < 12:
                h = one_cycle_height(i - 1, 5, 7, 0, 0)
                lr, beta1 = 1e-3 + 9e-3 * h, 0.9 - 0.1 * h
            else:
                lr, beta1 = 1e-3 / (1 + 0.1 * (i - 12) / 3), 0.9
            reference_optimizer.param_groups[0].update(lr=lr, betas=(beta1, 0.99))
        else:  # construction wrote DeepSpeed's (cycle_min_mom, 0.99)
            reference_optimizer.param_groups[0].update(lr=1e-3, betas=(0.8, 0.99))
        optimizer.step()
        reference_optimizer.step()
        scheduler.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-9)
        lrs_used.add(optimizer.param_groups[0]["lr"])
    assert len(lrs_used) >= 15  # the schedule really moved the lr


def test_tensor_lr_is_filled_in_place():
    lr = torch.tensor(0.1)
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.randn(3))], lr=lr, foreach=False)
    scheduler = WarmupLR(optimizer, 0.0, 0.2, 10, "linear")
    scheduler.step(5)
    assert optimizer.param_groups[0]["lr"] is lr
    assert float(lr) == float(torch.tensor(0.1, dtype=torch.float32))


def test_wrapped_optimizer_is_unwrapped():
    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    optimizer = _optimizer(1)
    scheduler = WarmupLR(Wrapper(optimizer), 0.0, 0.2, 10, "linear")
    scheduler.step(5)
    _close(optimizer.param_groups[0]["lr"], 0.1)


# ---- the factory -----------------------------------------------------------------------------


def test_factory_builds_every_schedule_by_deepspeed_name():
    assert SCHEDULER_NAMES == (
        "LRRangeTest",
        "OneCycle",
        "WarmupLR",
        "WarmupDecayLR",
        "WarmupCosineLR",
    )
    params = {
        "LRRangeTest": {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 10},
        "OneCycle": {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 4},
        "WarmupLR": {"warmup_min_lr": 0, "warmup_max_lr": 0.003, "warmup_num_steps": 10},
        "WarmupDecayLR": {"total_num_steps": 1000, "last_batch_iteration": -1},
        "WarmupCosineLR": {"total_num_steps": 2000, "warmup_min_ratio": 0.5},
    }
    for name in SCHEDULER_NAMES:
        optimizer = _optimizer(1, lr=0.004)
        scheduler = build_lr_scheduler(name, params[name], optimizer)
        assert type(scheduler).__name__ == name
        scheduler.step(0)
    scheduler = build_lr_scheduler("WarmupCosineLR", params["WarmupCosineLR"], _optimizer(1))
    assert (scheduler.warmup_num_steps, scheduler.cos_min_ratio) == (1000, 0.0001)
    assert build_lr_scheduler("WarmupLR", None, _optimizer(1)).warmup_num_steps == 1000


def test_factory_errors_name_the_problem():
    optimizer = _optimizer(1)
    with pytest.raises(
        ValueError, match=r"scheduler.type must be one of \('LRRangeTest'.*'warmuplr'"
    ):
        build_lr_scheduler("warmuplr", {}, optimizer)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['warmup_steps'\] for WarmupLR"):
        build_lr_scheduler("WarmupLR", {"warmup_steps": 10}, optimizer)
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['total_num_steps'\]"):
        build_lr_scheduler("WarmupDecayLR", {"warmup_num_steps": 10}, optimizer)
    with pytest.raises(TypeError, match="scheduler.params must be a dict"):
        build_lr_scheduler("WarmupLR", [1, 2], optimizer)


# ---- argument validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda o: WarmupLR(o, warmup_num_steps=0),
            r"warmup_num_steps must be an integer >= 1, got 0",
        ),
        (
            lambda o: WarmupLR(o, warmup_num_steps=2.5),
            r"warmup_num_steps must be an integer >= 1, got 2.5",
        ),
        (
            lambda o: WarmupLR(o, warmup_max_lr="auto"),
            r"warmup_max_lr must be a finite number, got 'auto'",
        ),
        (lambda o: WarmupLR(o, warmup_min_lr=-0.1), r"warmup_min_lr must be >= 0, got -0.1"),
        (
            lambda o: WarmupLR(o, warmup_min_lr=[0.0]),
            r"warmup_min_lr must be a number or a list with one value per param group \(2\), got 1",
        ),
        (
            lambda o: WarmupLR(o, warmup_max_lr=[0.1, float("nan")]),
            r"warmup_max_lr\[1\] must be a finite number, got nan",
        ),
        (
            lambda o: WarmupLR(o, last_batch_iteration=-2),
            r"last_batch_iteration must be an integer >= -1, got -2",
        ),
        (
            lambda o: WarmupDecayLR(o, total_num_steps=50, warmup_num_steps=100),
            r"total_num_steps \(50\) must be >= warmup_num_steps \(100\)",
        ),
        (
            lambda o: WarmupDecayLR(o, total_num_steps=0),
            r"total_num_steps must be an integer >= 1, got 0",
        ),
        (
            lambda o: WarmupCosineLR(o, total_num_steps=10, warmup_num_steps=20),
            r"total_num_steps \(10\) must be >= warmup_num_steps \(20\)",
        ),
        (
            lambda o: WarmupCosineLR(o, total_num_steps=100, warmup_num_steps=5, cos_min_ratio=1.5),
            r"cos_min_ratio must be <= 1, got 1.5",
        ),
        (
            lambda o: WarmupCosineLR(
                o, total_num_steps=100, warmup_num_steps=5, warmup_min_ratio=-1
            ),
            r"warmup_min_ratio must be >= 0, got -1",
        ),
        (
            lambda o: OneCycle(o, 0.1, 1.0, cycle_first_step_size=0),
            r"cycle_first_step_size must be an integer >= 1, got 0",
        ),
        (
            lambda o: OneCycle(o, 0.1, 1.0, cycle_second_step_size=-3),
            r"cycle_second_step_size must be an integer >= 0, got -3",
        ),
        (
            lambda o: OneCycle(o, 0.1, 1.0, decay_step_size=-1),
            r"decay_step_size must be an integer >= 0, got -1",
        ),
        (
            lambda o: OneCycle(o, 0.1, 1.0, decay_lr_rate=-0.5),
            r"decay_lr_rate must be >= 0, got -0.5",
        ),
        (
            lambda o: OneCycle(o, 0.1, 1.0, cycle_max_mom=1.2),
            r"cycle_max_mom must be <= 1, got 1.2",
        ),
        (
            lambda o: OneCycle(o, 0.1, 1.0, cycle_first_stair_count=1.5),
            r"cycle_first_stair_count must be an integer, got 1.5",
        ),
        (
            lambda o: OneCycle(o, 0.1, 1.0, cycle_momentum="yes"),
            r"cycle_momentum must be a bool, got 'yes'",
        ),
        (
            lambda o: LRRangeTest(o, lr_range_test_step_size=0),
            r"lr_range_test_step_size must be an integer >= 1, got 0",
        ),
        (
            lambda o: LRRangeTest(o, lr_range_test_step_rate=-1.0),
            r"lr_range_test_step_rate must be >= 0, got -1.0",
        ),
    ],
)
def test_bad_arguments_are_named_with_value_and_expectation(make, message):
    with pytest.raises(ValueError, match=message):
        make(_optimizer(2))


def test_bad_optimizer_and_state_dict_errors():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer.*got dict"):
        WarmupLR({"lr": 0.1})
    scheduler = WarmupLR(_optimizer(1))
    with pytest.raises(
        ValueError, match=r"needs the key 'last_batch_iteration', got keys \['step'\]"
    ):
        scheduler.load_state_dict({"step": 3})
    with pytest.raises(
        ValueError, match=r"state_dict\['last_batch_iteration'\] must be an integer >= -1, got 'x'"
    ):
        scheduler.load_state_dict({"last_batch_iteration": "x"})
