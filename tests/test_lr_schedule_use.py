"""LR schedules in use: state dicts and resuming, explicit iterations, real optimizers stepped
with the scheduled rates, the factory by DeepSpeed's names, and bad arguments named with their
value (the schedules' values step by step: test_lr_schedules.py)."""

import copy

import pytest
import torch
from lr_schedule_checks import (
    assert_lrs_close,
    make_optimizer,
    one_cycle_height,
    random_int,
    warmup_cosine_reference,
    warmup_decay_reference,
)

from deepspeed_cpp.runtime.lr_schedules import (
    SCHEDULER_NAMES,
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    build_lr_scheduler,
)

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
    optimizer = make_optimizer(2)
    scheduler = make(optimizer)
    for _ in range(random_int(3, 25)):
        scheduler.step()
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    saved_scheduler = copy.deepcopy(scheduler.state_dict())
    assert saved_scheduler["last_batch_iteration"] == scheduler.last_batch_iteration

    # A resumed run: fresh objects built the same way, then both state dicts loaded.
    resumed_optimizer = make_optimizer(2)
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


@pytest.mark.parametrize("name", SCHEDULES)
def test_check_state_dict_refuses_as_loading_would_and_changes_nothing(name):
    """What a checkpoint runs before it restores anything (runtime/checkpoint/loader.py)."""
    optimizer = make_optimizer(2)
    scheduler = SCHEDULES[name](optimizer)
    for _ in range(random_int(2, 9)):
        scheduler.step()
    before = (copy.deepcopy(scheduler.state_dict()), scheduler.get_last_lr(), dict(vars(scheduler)))
    other = SCHEDULES[name](make_optimizer(2))
    for _ in range(random_int(10, 20)):
        other.step()
    scheduler.check_state_dict(other.state_dict())  # would load: nothing raised
    with pytest.raises(ValueError, match="needs the key 'last_batch_iteration'"):
        scheduler.check_state_dict({"step_size": 3})
    with pytest.raises(ValueError, match="last_batch_iteration"):
        scheduler.check_state_dict({**other.state_dict(), "last_batch_iteration": -2})
    after = (scheduler.state_dict(), scheduler.get_last_lr(), dict(vars(scheduler)))
    assert after[:2] == before[:2]
    assert after[2].keys() == before[2].keys()
    assert all(after[2][k] is before[2][k] or after[2][k] == before[2][k] for k in before[2])


def test_bases_read_from_the_optimizer_survive_a_scheduler_built_after_loading():
    optimizer = make_optimizer(1, lr=0.3)
    scheduler = WarmupCosineLR(optimizer, 30, 0.0, 5, 0.0, "linear")
    for _ in range(12):
        scheduler.step()
    state = scheduler.state_dict()
    late_optimizer = make_optimizer(1, lr=0.3)
    late_optimizer.load_state_dict(optimizer.state_dict())  # lr is now mid-cosine
    late = WarmupCosineLR(late_optimizer, 30, 0.0, 5, 0.0, "linear", last_batch_iteration=11)
    late.load_state_dict(state)
    scheduler.step()
    late.step()
    assert late.get_last_lr() == scheduler.get_last_lr()


def test_deepspeed_state_dict_with_only_the_index_loads():
    optimizer = make_optimizer(1, lr=0.3)
    scheduler = WarmupCosineLR(optimizer, 30, 0.0, 5, 0.0, "linear")
    scheduler.load_state_dict({"last_batch_iteration": 7})
    scheduler.step()
    assert_lrs_close(
        optimizer.param_groups[0]["lr"], warmup_cosine_reference(8, 0.3, 30, 0, 5, 0, "linear")
    )


def test_resuming_constructor_leaves_the_optimizer_alone_until_step():
    optimizer = make_optimizer(1, lr=0.123)
    scheduler = WarmupDecayLR(optimizer, 50, 0.0, 0.2, 10, "linear", last_batch_iteration=19)
    assert optimizer.param_groups[0]["lr"] == 0.123
    with pytest.raises(RuntimeError, match="last_batch_iteration=19.*call step\\(\\) first"):
        scheduler.get_last_lr()
    scheduler.step()
    assert_lrs_close(
        optimizer.param_groups[0]["lr"], warmup_decay_reference(20, 0, 0.2, 10, 50, "linear")
    )


def test_step_to_an_explicit_iteration():
    optimizer = make_optimizer(1)
    scheduler = WarmupLR(optimizer, 0.0, 1.0, 100, "linear")
    scheduler.step(37)
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.37)
    scheduler.step()
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.38)
    scheduler.step(-1)
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.0)


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

    optimizer = make_optimizer(1)
    scheduler = WarmupLR(Wrapper(optimizer), 0.0, 0.2, 10, "linear")
    scheduler.step(5)
    assert_lrs_close(optimizer.param_groups[0]["lr"], 0.1)


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
        optimizer = make_optimizer(1, lr=0.004)
        scheduler = build_lr_scheduler(name, params[name], optimizer)
        assert type(scheduler).__name__ == name
        scheduler.step(0)
    scheduler = build_lr_scheduler("WarmupCosineLR", params["WarmupCosineLR"], make_optimizer(1))
    assert (scheduler.warmup_num_steps, scheduler.cos_min_ratio) == (1000, 0.0001)
    assert build_lr_scheduler("WarmupLR", None, make_optimizer(1)).warmup_num_steps == 1000


def test_factory_errors_name_the_problem():
    optimizer = make_optimizer(1)
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
        make(make_optimizer(2))


def test_bad_optimizer_and_state_dict_errors():
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer.*got dict"):
        WarmupLR({"lr": 0.1})
    scheduler = WarmupLR(make_optimizer(1))
    with pytest.raises(
        ValueError, match=r"needs the key 'last_batch_iteration', got keys \['step'\]"
    ):
        scheduler.load_state_dict({"step": 3})
    with pytest.raises(
        ValueError, match=r"state_dict\['last_batch_iteration'\] must be an integer >= -1, got 'x'"
    ):
        scheduler.load_state_dict({"last_batch_iteration": "x"})
