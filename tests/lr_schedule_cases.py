"""The learning-rate schedule cases checked against DeepSpeed's own values: the parameter grids of
DeepSpeed's tests/unit/runtime/test_lr_schedulers.py and a few edge cases. ``run_case`` runs one
case on a schedule module (DeepSpeed's ``deepspeed.runtime.lr_schedules`` in the fixture generator,
``deepspeed_cpp.runtime.lr_schedules`` in the test) and returns plain numbers."""

from __future__ import annotations

import warnings

import torch

OPT_LR = 0.00015  # the Adam lr of DeepSpeed's tests


def _case(cls, steps, groups=(OPT_LR,), step_args=None, optimizer="Adam", **kwargs):
    return {"cls": cls, "kwargs": kwargs, "groups": list(groups), "steps": steps,
            "step_args": step_args, "optimizer": optimizer}  # fmt: skip


CASES = {
    # TestGetLrBeforeTrain
    "before_train_warmup": _case("WarmupLR", 12),
    "before_train_warmup_decay": _case(
        "WarmupDecayLR", 25, warmup_num_steps=10, total_num_steps=20
    ),
    "before_train_warmup_cosine": _case(
        "WarmupCosineLR", 25, warmup_num_steps=10, total_num_steps=20
    ),
    "before_train_one_cycle": _case("OneCycle", 25, cycle_min_lr=0, cycle_max_lr=0.1),
    "before_train_range": _case("LRRangeTest", 12),
    # TestSchedulerOptimizerParity
    "parity_warmup_decay": _case("WarmupDecayLR", 25, warmup_num_steps=5, total_num_steps=10),
    "parity_one_cycle": _case(
        "OneCycle",
        25,
        cycle_min_lr=0,
        cycle_max_lr=0.1,
        cycle_first_step_size=5,
        decay_step_size=5,
    ),
    "parity_range": _case("LRRangeTest", 12, lr_range_test_min_lr=1e-4, lr_range_test_step_size=1),
    # TestLrRange
    **{
        f"range_{i}": _case(
            "LRRangeTest",
            50,
            lr_range_test_min_lr=a,
            lr_range_test_step_rate=b,
            lr_range_test_step_size=c,
            lr_range_test_staircase=d,
        )
        for i, (a, b, c, d) in enumerate(
            [
                (1e-4, 1e-5, 1, True),
                (1e-5, 1e-5, 1, False),
                (1e-4, 1e-3, 10, True),
                (1e-3, 1e-3, 10, False),
                (1e-2, 1e-2, 19, True),
                (1e-2, 1e-2, 19, False),
            ]
        )
    },
    # TestOneCycle.test_lr / test_mom
    **{
        f"one_cycle_lr_{i}": _case(
            "OneCycle",
            max(50, c * 3),
            cycle_min_lr=a,
            cycle_max_lr=b,
            decay_lr_rate=r,
            cycle_first_step_size=c,
            decay_step_size=d,
        )
        for i, (a, b, r, c, d) in enumerate(
            [
                (1e-5, 1e-2, 1e-3, 10, 10),
                (1e-3, 1e-1, 0, 21, 21),
                (1e-3, 1e-1, 1e-1, 21, 21),
                (1e-5, 1e-1, 0, 10, 0),
            ]
        )
    },
    **{
        f"one_cycle_mom_{i}": _case(
            "OneCycle",
            max(50, s * 3),
            cycle_min_lr=1e-3,
            cycle_max_lr=1e-2,
            cycle_min_mom=a,
            cycle_max_mom=b,
            decay_mom_rate=r,
            cycle_first_step_size=s,
            decay_step_size=s,
        )
        for i, (a, b, r, s) in enumerate([(0.08, 0.09, 1e-3, 10), (0.08, 0.09, 0, 21)])
    },
    # TestWarmupCosineLR (opt lr 0.0015)
    **{
        f"warmup_cosine_{i}": _case(
            "WarmupCosineLR",
            t + 3,
            groups=(0.0015,),
            total_num_steps=t,
            warmup_num_steps=w,
            cos_min_ratio=c,
            warmup_min_ratio=m,
        )
        for i, (t, w, c, m) in enumerate(
            [
                (100, 10, 0.1, 0.2),
                (200, 20, 0.1, 0.2),
                (500, 30, 0.0, 0.2),
                (600, 300, 0.1, 0.0),
                (600, 550, 0.0, 0.0),
            ]
        )
    },
    # TestLrSchedule: warmup / warmup-decay over warmup lengths and types
    **{
        f"warmup_{kind}_{n}": _case(
            "WarmupLR",
            2 * n + 2,
            warmup_min_lr=0.1,
            warmup_max_lr=0.2,
            warmup_num_steps=n,
            warmup_type=kind,
        )
        for n in (10, 15, 19, 33)
        for kind in ("log", "linear")
    },
    **{
        f"warmup_decay_{kind}_{n}": _case(
            "WarmupDecayLR",
            2 * n + 2,
            warmup_min_lr=0.1,
            warmup_max_lr=0.2,
            warmup_num_steps=n,
            total_num_steps=2 * n,
            warmup_type=kind,
        )
        for n in (10, 15, 19, 33)
        for kind in ("log", "linear")
    },
    # Edge cases: unknown warmup type (DeepSpeed warns and uses "log"), a zero second cycle
    # half, per-group lists, several groups, explicit step positions.
    "warmup_unknown_type": _case("WarmupLR", 12, warmup_num_steps=10, warmup_type="cubic"),
    "warmup_cosine_unknown_type": _case(
        "WarmupCosineLR", 15, total_num_steps=100, warmup_num_steps=10, warmup_type="cubic"
    ),
    "warmup_cosine_linear": _case(
        "WarmupCosineLR",
        15,
        total_num_steps=100,
        warmup_num_steps=10,
        warmup_min_ratio=0.0,
        warmup_type="linear",
    ),
    "warmup_cosine_total_is_warmup": _case(
        "WarmupCosineLR",
        14,
        groups=(0.01,),
        total_num_steps=10,
        warmup_num_steps=10,
        cos_min_ratio=0.1,
    ),
    "one_cycle_zero_second_half": _case(
        "OneCycle",
        6,
        groups=(0.1,),
        cycle_min_lr=0.001,
        cycle_max_lr=0.1,
        cycle_first_step_size=100,
        cycle_second_step_size=0,
    ),
    "one_cycle_per_group_lists": _case(
        "OneCycle",
        12,
        groups=(0.1, 0.2),
        cycle_min_lr=[0.001, 0.002],
        cycle_max_lr=[0.01, 0.02],
        cycle_min_mom=[0.8, 0.85],
        cycle_max_mom=[0.9, 0.95],
        cycle_first_step_size=5,
        cycle_second_step_size=5,
    ),
    "warmup_two_groups_inherit": _case("WarmupLR", 12, groups=(0.1, 0.2), warmup_num_steps=10),
    "warmup_cosine_two_groups": _case(
        "WarmupCosineLR",
        12,
        groups=(0.0015, 0.003),
        total_num_steps=100,
        warmup_num_steps=10,
        warmup_min_ratio=0.0,
    ),
    "warmup_decay_explicit_steps": _case(
        "WarmupDecayLR",
        0,
        step_args=[1, 5, 5, 12, 3, 30],
        warmup_num_steps=10,
        total_num_steps=20,
        warmup_max_lr=0.1,
    ),
    "one_cycle_sgd": _case(
        "OneCycle", 8, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=3, optimizer="SGD"
    ),
    "one_cycle_explicit_steps": _case(
        "OneCycle",
        0,
        step_args=[4, 9, 0, 25],
        groups=(0.1,),
        cycle_min_lr=0.01,
        cycle_max_lr=0.1,
        cycle_first_step_size=10,
        cycle_second_step_size=10,
        cycle_momentum=False,
    ),
}


def _snapshot(scheduler, optimizer, with_momentum: bool) -> dict:
    state = {
        "get_lr": [float(x) for x in scheduler.get_lr()],
        "group_lr": [float(g["lr"]) for g in optimizer.param_groups],
    }
    if "momentum" in optimizer.param_groups[0]:
        state["group_momentum"] = [float(g["momentum"]) for g in optimizer.param_groups]
    if with_momentum:
        state["group_betas"] = [float(b) for g in optimizer.param_groups for b in g["betas"]]
        momenta = scheduler.get_mom()
        state["get_mom"] = [] if momenta is None else [_beta1(m) for m in momenta]
    return state


def _beta1(momentum) -> float:
    """DeepSpeed's get_mom() gives (beta1, beta2) pairs; deepspeed_cpp's the same."""
    return float(momentum[0] if isinstance(momentum, (tuple, list)) else momentum)


def run_case(module, case: dict) -> dict:
    """The case's schedule on ``module``: its state after construction and after each step, or
    the exception's class name where construction or a step raises."""
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in case["groups"]]
    groups = [{"params": [p], "lr": lr} for p, lr in zip(params, case["groups"])]
    if case["optimizer"] == "SGD":
        optimizer = torch.optim.SGD(groups, momentum=0.5)
    else:
        optimizer = torch.optim.Adam(groups, betas=(0.9, 0.999))
    with_momentum = case["cls"] == "OneCycle" and case["optimizer"] == "Adam"
    trace = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scheduler = getattr(module, case["cls"])(optimizer, **case["kwargs"])
            trace.append(_snapshot(scheduler, optimizer, with_momentum))
            steps = case["step_args"] or [None] * case["steps"]
            for position in steps:
                if position is None:
                    scheduler.step()
                else:
                    scheduler.step(position)
                trace.append(_snapshot(scheduler, optimizer, with_momentum))
    except Exception as error:  # noqa: BLE001 - recorded: the test expects the same class
        return {"trace": trace, "error": type(error).__name__}
    return {"trace": trace, "error": None}
