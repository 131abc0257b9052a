"""Per-batch learning-rate schedules with DeepSpeed's names, arguments, defaults and formulas.

DeepSpeed's engine calls ``scheduler.step()`` once per optimizer step, so every schedule here is
a function of ``last_batch_iteration``: the index of the last batch trained, ``-1`` before the
first. ``step()`` advances it by one (or sets it), computes one value per param group and writes
it into ``group["lr"]`` (a tensor ``lr`` is filled in place, so capturable optimizers keep
working). The state dict holds that index (DeepSpeed's layout) and any lrs the schedule read
from the optimizer at construction, so a checkpoint resumes the schedule exactly.

Construction with ``last_batch_iteration=-1`` (a fresh run) writes the schedule's value at
``-1`` into the optimizer at once, as DeepSpeed does: the first optimizer step already runs at
the warm-up's start (``WarmupCosineLR`` writes 0 there, DeepSpeed's value). Any other value means
"resuming": the optimizer's lrs (restored from its own state dict) are left alone until the
next ``step()``.

``build_lr_scheduler(name, params, optimizer)`` builds one from a ``ds_config.json``
``scheduler`` section.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence

import torch

from ..utils.logging import logger
from .lr_schedule_base import (  # noqa: F401 - SECOND_BETA and WARMUP_TYPES stay importable here
    SECOND_BETA,
    WARMUP_TYPES,
    _BatchSchedule,
    _check_int,
    _check_real,
    _check_warmup_type,
    _per_group,
    _warmup_fraction,
    _write,
)

# DeepSpeed's schedule and parameter names (WARMUP_LR, WARMUP_NUM_STEPS, ...) under its path.
from .lr_schedule_keys import *  # noqa: F403

# --------------------------------------------------------------------------------------------
# The schedules.
# --------------------------------------------------------------------------------------------


class LRRangeTest(_BatchSchedule):
    """Learning-rate range test: grows the lr from ``lr_range_test_min_lr`` without bound.

    ``lr = min_lr * (1 + lr_range_test_step_rate * interval)`` where ``interval`` is
    ``(last_batch_iteration + 1) / lr_range_test_step_size``, floored when
    ``lr_range_test_staircase`` is true. Used to find the largest lr that still trains before
    choosing the bounds of a ``OneCycle`` schedule (Smith, arXiv:1803.09820).

    Args:
        optimizer: the optimizer whose param groups get the lr.
        lr_range_test_min_lr: starting lr, one number or one per param group.
        lr_range_test_step_size: batches per unit of ``interval`` (>= 1).
        lr_range_test_step_rate: growth per unit of ``interval`` (>= 0).
        lr_range_test_staircase: grow in whole steps instead of every batch.
        last_batch_iteration: index of the last batch trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer,
        lr_range_test_min_lr: float | Sequence[float] = 1e-3,
        lr_range_test_step_size: int = 2000,
        lr_range_test_step_rate: float = 1.0,
        lr_range_test_staircase: bool = False,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group("lr_range_test_min_lr", lr_range_test_min_lr, groups, minimum=0)
        self.step_size = _check_int("lr_range_test_step_size", lr_range_test_step_size, minimum=1)
        self.step_rate = _check_real("lr_range_test_step_rate", lr_range_test_step_rate, minimum=0)
        if not isinstance(lr_range_test_staircase, bool):
            raise ValueError(
                f"lr_range_test_staircase must be a bool, got {lr_range_test_staircase!r}"
            )
        self.staircase = lr_range_test_staircase
        self._start()

    def get_lr(self) -> list[float]:
        batches = self.last_batch_iteration + 1
        interval = batches // self.step_size if self.staircase else batches / self.step_size
        growth = 1.0 + self.step_rate * interval
        return [min_lr * growth for min_lr in self.min_lrs]


class OneCycle(_BatchSchedule):
    """The 1Cycle policy: one cycle of lr (and momentum) between two bounds, then decay.

    With ``first = cycle_first_step_size`` and ``second = cycle_second_step_size`` (default
    ``first``), batch ``b = last_batch_iteration + 1`` lies at ``offset = b mod (first +
    second)`` in the cycle, and the cycle's height is ``h = offset / first`` while rising
    (``offset <= first``), else ``(first + second - offset) / second``. A positive stair count
    for that half holds ``h`` flat in that many steps: ``h = floor(h * stairs) / stairs``.
    During the cycle (``last_batch_iteration < first + second``)::

        lr       = cycle_min_lr  + (cycle_max_lr  - cycle_min_lr)  * h
        momentum = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * h   (inverse to the lr)

    After it, with ``d = last_batch_iteration - (first + second) + 1`` batches of decay::

        lr       = cycle_min_lr  / (1 + decay_lr_rate  * d / decay_step_size)
        momentum = cycle_max_mom * (1 + decay_mom_rate * d / decay_step_size)

    each held at ``cycle_min_lr`` / ``cycle_max_mom`` when ``decay_step_size`` or its rate is 0.

    Momentum goes to ``betas`` as ``(momentum, 0.99)``, as DeepSpeed writes it (``betas[1]``
    too: a script trains with the same Adam betas as under DeepSpeed). An optimizer without
    ``betas`` in its defaults (SGD) turns momentum cycling off with a warning, as in DeepSpeed,
    and its ``momentum`` is left alone. At construction the optimizer gets ``cycle_min_lr`` and,
    as DeepSpeed writes it, ``cycle_min_mom`` (``get_mom()`` there says ``cycle_max_mom``, the
    value at ``h = 0``; the first ``step()`` writes that).

    Args:
        optimizer: the optimizer whose param groups get the lr (and momentum).
        cycle_min_lr, cycle_max_lr: lr bounds, one number or one per param group.
        decay_lr_rate: lr decay rate after the cycle.
        cycle_first_step_size: batches in the rising half (>= 1).
        cycle_second_step_size: batches in the falling half (>= 1); None means the first's.
        cycle_first_stair_count, cycle_second_stair_count: stairs per half; <= 0 means smooth;
            the second defaults to the first's.
        decay_step_size: batches per unit of decay; 0 disables decay.
        cycle_momentum: cycle momentum inversely to the lr.
        cycle_min_mom, cycle_max_mom: momentum bounds in [0, 1], one or one per group.
        decay_mom_rate: momentum change rate after the cycle.
        last_batch_iteration: index of the last batch trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer,
        cycle_min_lr: float | Sequence[float],
        cycle_max_lr: float | Sequence[float],
        decay_lr_rate: float = 0.0,
        cycle_first_step_size: int = 2000,
        cycle_second_step_size: int | None = None,
        cycle_first_stair_count: int = 0,
        cycle_second_stair_count: int | None = None,
        decay_step_size: int = 0,
        cycle_momentum: bool = True,
        cycle_min_mom: float | Sequence[float] = 0.8,
        cycle_max_mom: float | Sequence[float] = 0.9,
        decay_mom_rate: float = 0.0,
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        groups = len(self.optimizer.param_groups)
        self.min_lrs = _per_group("cycle_min_lr", cycle_min_lr, groups, minimum=0)
        self.max_lrs = _per_group("cycle_max_lr", cycle_max_lr, groups, minimum=0)
        self.decay_lr_rate = _check_real("decay_lr_rate", decay_lr_rate, minimum=0)
        self.first_step_size = _check_int("cycle_first_step_size", cycle_first_step_size, minimum=1)
        if cycle_second_step_size is None:
            cycle_second_step_size = self.first_step_size
        # 0 is allowed (DeepSpeed allows it): the cycle only rises, h = offset / first.
        self.second_step_size = _check_int(
            "cycle_second_step_size", cycle_second_step_size, minimum=0
        )
        self.total_size = self.first_step_size + self.second_step_size
        self.step_ratio = self.first_step_size / self.total_size  # DeepSpeed's attribute
        # Negative counts are DeepSpeed's command-line "off" value (-1); keep them meaning off.
        self.first_stair_count = _check_int("cycle_first_stair_count", cycle_first_stair_count)
        if cycle_second_stair_count is None:
            cycle_second_stair_count = self.first_stair_count
        self.second_stair_count = _check_int("cycle_second_stair_count", cycle_second_stair_count)
        self.decay_step_size = _check_int("decay_step_size", decay_step_size, minimum=0)
        if not isinstance(cycle_momentum, bool):
            raise ValueError(f"cycle_momentum must be a bool, got {cycle_momentum!r}")
        self.min_moms = _per_group("cycle_min_mom", cycle_min_mom, groups, minimum=0, maximum=1)
        self.max_moms = _per_group("cycle_max_mom", cycle_max_mom, groups, minimum=0, maximum=1)
        self.decay_mom_rate = _check_real("decay_mom_rate", decay_mom_rate)
        self.cycle_momentum = cycle_momentum and self._optimizer_has_betas()
        self._start()
        if self.last_batch_iteration == -1 and self.cycle_momentum:
            self._write_momenta(self.min_moms)  # DeepSpeed's value at construction

    def _optimizer_has_betas(self) -> bool:
        if "betas" in getattr(self.optimizer, "defaults", {}):
            return True
        logger.warning(
            "OneCycle: cycle_momentum is off because %s has no 'betas' in its defaults (as in "
            "DeepSpeed, only Adam-like betas are cycled)",
            type(self.optimizer).__name__,
        )
        return False

    def _height(self) -> float:
        """The cycle's height in [0, 1] at this batch: 0 at the lr floor, 1 at the peak."""
        offset = (self.last_batch_iteration + 1) % self.total_size
        if offset <= self.first_step_size:
            steps_up, half, stairs = offset, self.first_step_size, self.first_stair_count
        else:
            steps_up, half, stairs = (
                self.total_size - offset,
                self.second_step_size,
                self.second_stair_count,
            )
        if stairs > 0:
            # Integer floor: a float (steps_up / half) * stairs can land a hair under a whole
            # stair and drop the schedule one stair, even off the peak.
            return (steps_up * stairs // half) / stairs
        return steps_up / half

    def _decay_units(self) -> float:
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            height = self._height()
            return [lo + (hi - lo) * height for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.decay_step_size == 0 or self.decay_lr_rate == 0:
            return list(self.min_lrs)
        divisor = 1.0 + self.decay_lr_rate * self._decay_units()
        return [lo / divisor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        """Every param group's betas at this batch, ``(momentum, 0.99)`` as DeepSpeed gives them,
        or None when momentum is not cycled."""
        if not self.cycle_momentum:
            return None
        return [(momentum, SECOND_BETA) for momentum in self._momenta()]

    def _momenta(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            height = self._height()
            return [hi - (hi - lo) * height for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.decay_step_size == 0 or self.decay_mom_rate == 0:
            return list(self.max_moms)
        factor = 1.0 + self.decay_mom_rate * self._decay_units()
        return [hi * factor for hi in self.max_moms]

    def _apply(self) -> None:
        super()._apply()
        if self.cycle_momentum:
            self._write_momenta(self._momenta())

    def _write_momenta(self, momenta: list[float]) -> None:
        for group, momentum in zip(self.optimizer.param_groups, momenta):
            betas = group.get("betas")
            if betas is not None and isinstance(betas[0], torch.Tensor):
                betas[0].fill_(momentum)
                if isinstance(betas[1], torch.Tensor):
                    betas[1].fill_(SECOND_BETA)
                else:
                    group["betas"] = (betas[0], SECOND_BETA)
            else:
                group["betas"] = (momentum, SECOND_BETA)


class WarmupLR(_BatchSchedule):
    """Warms the lr up from ``warmup_min_lr`` to ``warmup_max_lr``, then holds it there.

    ``lr = min + (max - min) * w`` where, for ``last_batch_iteration = i`` and
    ``W = max(2, warmup_num_steps)`` (DeepSpeed's floor, which keeps ``log(W)`` non-zero),
    ``w = log(i + 1) / log(W)`` ("log") or ``i / W`` ("linear") while ``i < W``, else 1.
    Before the first batch (``i = -1``) the lr is ``warmup_min_lr``; so is batch 0.

    Args:
        optimizer: the optimizer whose param groups get the lr.
        warmup_min_lr: lr at the start, one number or one per param group.
        warmup_max_lr: lr after warm-up, one number or one per group; None (DeepSpeed's
            default) takes each group's lr in the optimizer at construction.
        warmup_num_steps: warm-up length in batches (>= 1).
        warmup_type: "log" or "linear".
        last_batch_iteration: index of the last batch trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] | None = None,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        groups = len(self.optimizer.param_groups)
        # Read from the optimizer rather than the config, so kept in the state dict.
        self._max_lrs_from_optimizer = warmup_max_lr is None
        if warmup_max_lr is None:
            warmup_max_lr = [float(group["lr"]) for group in self.optimizer.param_groups]
        self.min_lrs = _per_group("warmup_min_lr", warmup_min_lr, groups, minimum=0)
        self.max_lrs = _per_group("warmup_max_lr", warmup_max_lr, groups, minimum=0)
        self.warmup_num_steps = max(2, _check_int("warmup_num_steps", warmup_num_steps, minimum=1))
        self.warmup_type = _check_warmup_type(warmup_type)
        self._check_schedule_length(warmup_num_steps)
        self._start()

    def _check_schedule_length(self, warmup_num_steps: int) -> None:
        """Hook for schedules with an end (``WarmupDecayLR``)."""

    def _gamma(self) -> float:
        """The fraction of ``max - min`` added to ``min`` at this batch."""
        if self.last_batch_iteration < self.warmup_num_steps:
            return _warmup_fraction(
                self.last_batch_iteration, self.warmup_num_steps, self.warmup_type
            )
        return 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]

    def _captured_state(self) -> dict:
        return {"warmup_max_lrs": list(self.max_lrs)} if self._max_lrs_from_optimizer else {}

    def _restore_captured_state(self, state_dict: dict) -> None:
        if "warmup_max_lrs" in state_dict:
            self.max_lrs = _per_group(
                "state_dict['warmup_max_lrs']",
                list(state_dict["warmup_max_lrs"]),
                len(self.optimizer.param_groups),
                minimum=0,
            )


class WarmupDecayLR(WarmupLR):
    """``WarmupLR``'s warm-up, then a linear decay that reaches 0 at ``total_num_steps``.

    With ``W = max(2, warmup_num_steps)`` and ``T = total_num_steps``, for ``i >= W``:
    ``lr = min + (max - min) * max(0, (T - i) / max(1, T - W))``: the full ``max`` at ``W``,
    ``min`` at ``T`` and after.

    Args:
        optimizer: the optimizer whose param groups get the lr.
        total_num_steps: batches in the whole schedule (>= warmup_num_steps).
        warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration:
            as in ``WarmupLR``, except that ``warmup_max_lr`` defaults to 0.001 (DeepSpeed's).
    """

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_lr: float | Sequence[float] = 0.0,
        warmup_max_lr: float | Sequence[float] = 0.001,
        warmup_num_steps: int = 1000,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, minimum=1)
        super().__init__(
            optimizer,
            warmup_min_lr,
            warmup_max_lr,
            warmup_num_steps,
            warmup_type,
            last_batch_iteration,
        )

    def _check_schedule_length(self, warmup_num_steps: int) -> None:
        if self.total_num_steps < warmup_num_steps:
            raise ValueError(
                f"total_num_steps ({self.total_num_steps}) must be >= warmup_num_steps "
                f"({warmup_num_steps}): the decay would start after the schedule's end"
            )

    def _gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super()._gamma()
        remaining = self.total_num_steps - self.last_batch_iteration
        return max(0.0, remaining / max(1, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(_BatchSchedule):
    """Warm-up of the lr *ratio*, then a cosine decay to ``cos_min_ratio``; lr = ratio * base.

    ``base`` is each group's lr in the optimizer at construction. With ``W = max(2,
    warmup_num_steps)``, ``T = total_num_steps`` and ``i = last_batch_iteration``:

    - ``i < W``: ``ratio = warmup_min_ratio + (1 - warmup_min_ratio) * w`` with ``w`` the
      "log"/"linear" warm-up fraction of ``WarmupLR``;
    - ``i >= W``: ``p = min(1, (i - W + 1) / max(1, T - W))`` and
      ``ratio = cos_min_ratio + (1 - cos_min_ratio) * (1 + cos(pi * p)) / 2``, so the floor is
      reached at ``i = T - 1`` and held after it.

    Before the first batch (``i = -1``) the ratio is 0 (DeepSpeed's value).

    Args:
        optimizer: the optimizer whose param groups get the lr; their lrs are the bases.
        total_num_steps: batches in the whole schedule (>= warmup_num_steps).
        warmup_min_ratio: ratio at the start of warm-up, in [0, 1].
        warmup_num_steps: warm-up length in batches (>= 1).
        cos_min_ratio: ratio at the end of the cosine, in [0, 1].
        warmup_type: "log" or "linear".
        last_batch_iteration: index of the last batch trained; -1 starts afresh.
    """

    def __init__(
        self,
        optimizer,
        total_num_steps: int,
        warmup_min_ratio: float = 0.0,
        warmup_num_steps: int = 1000,
        cos_min_ratio: float = 0.0001,
        warmup_type: str = "log",
        last_batch_iteration: int = -1,
    ):
        super().__init__(optimizer, last_batch_iteration)
        self.total_num_steps = _check_int("total_num_steps", total_num_steps, minimum=1)
        self.warmup_min_ratio = _check_real(
            "warmup_min_ratio", warmup_min_ratio, minimum=0, maximum=1
        )
        requested_warmup = _check_int("warmup_num_steps", warmup_num_steps, minimum=1)
        if self.total_num_steps < requested_warmup:
            raise ValueError(
                f"total_num_steps ({self.total_num_steps}) must be >= warmup_num_steps "
                f"({requested_warmup}): the cosine would start after the schedule's end"
            )
        self.warmup_num_steps = max(2, requested_warmup)
        self.cos_min_ratio = _check_real("cos_min_ratio", cos_min_ratio, minimum=0, maximum=1)
        self.warmup_type = _check_warmup_type(warmup_type)
        self.base_lrs = [
            _check_real(f"optimizer.param_groups[{i}]['lr']", float(group["lr"]), minimum=0)
            for i, group in enumerate(self.optimizer.param_groups)
        ]
        self._start()

    def get_lr_ratio(self) -> float:
        """The fraction of each group's base lr at this batch."""
        i = self.last_batch_iteration
        if i < 0:
            return 0.0
        if i < self.warmup_num_steps:
            w = _warmup_fraction(i, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + (1.0 - self.warmup_min_ratio) * w
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, (i - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine

    def get_lr(self) -> list[float]:
        ratio = self.get_lr_ratio()
        return [base * ratio for base in self.base_lrs]

    def _captured_state(self) -> dict:
        return {"base_lrs": list(self.base_lrs)}

    def _restore_captured_state(self, state_dict: dict) -> None:
        if "base_lrs" in state_dict:
            self.base_lrs = _per_group(
                "state_dict['base_lrs']",
                list(state_dict["base_lrs"]),
                len(self.optimizer.param_groups),
                minimum=0,
            )


# --------------------------------------------------------------------------------------------
# The factory for a ds_config.json "scheduler" section.
# --------------------------------------------------------------------------------------------

_SCHEDULERS = {
    cls.__name__: cls for cls in (LRRangeTest, OneCycle, WarmupLR, WarmupDecayLR, WarmupCosineLR)
}
SCHEDULER_NAMES = tuple(_SCHEDULERS)
# DeepSpeed's name for the same list (code that checks `type(s).__name__ in VALID_LR_SCHEDULES`).
VALID_LR_SCHEDULES = list(SCHEDULER_NAMES)


def build_lr_scheduler(name: str, params: dict | None, optimizer):
    """Builds the schedule ``scheduler.type = name`` with ``scheduler.params = params``.

    ``name`` is case-sensitive, as in DeepSpeed's config (one of ``SCHEDULER_NAMES``); the
    keys of ``params`` are the schedule's constructor arguments.
    """
    if name not in _SCHEDULERS:
        raise ValueError(f"scheduler.type must be one of {SCHEDULER_NAMES}, got {name!r}")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise TypeError(
            f"scheduler.params must be a dict of {name}'s arguments, got {type(params).__name__}"
        )
    cls = _SCHEDULERS[name]
    arguments = dict(inspect.signature(cls.__init__).parameters)
    del arguments["self"], arguments["optimizer"]
    unknown = sorted(set(params) - set(arguments))
    if unknown:
        raise ValueError(
            f"scheduler.params has unknown key(s) {unknown} for {name}; valid keys: "
            f"{sorted(arguments)}"
        )
    missing = sorted(
        key
        for key, argument in arguments.items()
        if argument.default is inspect.Parameter.empty and key not in params
    )
    if missing:
        raise ValueError(f"scheduler.params for {name} is missing required key(s) {missing}")
    return cls(optimizer, **params)
