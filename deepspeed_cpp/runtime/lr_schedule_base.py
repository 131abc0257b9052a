"""The mechanics every learning-rate schedule of ``lr_schedules.py`` shares: argument checks
whose messages name the argument, its value and what was expected; the optimizer the schedule
writes; and ``_BatchSchedule``, the iteration bookkeeping, optimizer writes and state dicts."""

from __future__ import annotations

import copy
import math
import numbers

import torch

from ..utils.logging import logger

WARMUP_TYPES = ("log", "linear")
# OneCycle writes betas as (momentum, SECOND_BETA), DeepSpeed's constant second beta.
SECOND_BETA = 0.99


# --------------------------------------------------------------------------------------------
# Argument checks: every message names the argument, its value and what was expected.
# --------------------------------------------------------------------------------------------


def _check_real(name: str, value, *, minimum: float | None = None, maximum: float | None = None):
    """A finite real number (not a bool, not a string such as an unfilled "auto")."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value!r}")
    return float(value)


def _check_int(name: str, value, *, minimum: int | None = None) -> int:
    expected = "an integer" if minimum is None else f"an integer >= {minimum}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def _per_group(name: str, value, num_groups: int, **bounds) -> list[float]:
    """One number for every param group, or a list/tuple with one number per group."""
    if isinstance(value, (list, tuple)):
        if len(value) != num_groups:
            raise ValueError(
                f"{name} must be a number or a list with one value per param group "
                f"({num_groups}), got {len(value)} values: {value!r}"
            )
        return [_check_real(f"{name}[{i}]", v, **bounds) for i, v in enumerate(value)]
    return [_check_real(name, value, **bounds)] * num_groups


def _check_warmup_type(value) -> str:
    """``value``, or "log" with a warning when it is not a known type: DeepSpeed warns and warms
    up on the log curve, so a script with another value trains there as it does in DeepSpeed."""
    if value not in WARMUP_TYPES:
        logger.warning(
            "warmup_type=%r is not one of %s; using 'log' (as DeepSpeed does)", value, WARMUP_TYPES
        )
        return "log"
    return value


def _torch_optimizer(optimizer):
    """The object whose ``param_groups`` the schedule writes (DeepSpeed also accepts wrappers)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    groups = getattr(optimizer, "param_groups", None)
    if isinstance(groups, list) and all(isinstance(g, dict) for g in groups):
        return optimizer
    raise TypeError(
        f"optimizer must be a torch.optim.Optimizer (or wrap one as .optimizer), "
        f"got {type(optimizer).__name__}"
    )


def _write(group: dict, key: str, value: float) -> None:
    """Sets a hyper-parameter, in place when the optimizer keeps it as a tensor."""
    current = group.get(key)
    if isinstance(current, torch.Tensor):
        current.fill_(value)
    else:
        group[key] = value


def _warmup_fraction(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """How far warm-up has come at ``iteration`` (< warmup_num_steps): 0 at iteration 0."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_num_steps)
    return iteration / warmup_num_steps


# --------------------------------------------------------------------------------------------
# The shared mechanics: iteration bookkeeping, writing the optimizer, state dicts.
# --------------------------------------------------------------------------------------------


class _BatchSchedule:
    """Base of every schedule: subclasses define ``get_lr()`` for ``self.last_batch_iteration``."""

    def __init__(self, optimizer, last_batch_iteration: int):
        self.optimizer = _torch_optimizer(optimizer)
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", last_batch_iteration, minimum=-1
        )
        self._last_lr: list[float] | None = None

    def _start(self) -> None:
        """Called at the end of a subclass's constructor, once its parameters are known."""
        if self.last_batch_iteration == -1:
            self._apply()

    def get_lr(self) -> list[float]:
        """The learning rate of every param group at ``self.last_batch_iteration``."""
        raise NotImplementedError

    def _apply(self) -> None:
        lrs = self.get_lr()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            _write(group, "lr", lr)
        self._last_lr = lrs

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advances to the next batch (or to ``last_batch_iteration``) and writes its lrs."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = _check_int(
            "last_batch_iteration", last_batch_iteration, minimum=-1
        )
        self._apply()

    def get_last_lr(self) -> list[float]:
        """The lrs this schedule last wrote into the optimizer, one per param group."""
        if self._last_lr is None:
            raise RuntimeError(
                f"{type(self).__name__}.get_last_lr(): no learning rate has been set yet; the "
                f"schedule was created with last_batch_iteration={self.last_batch_iteration} "
                "(resuming), so call step() first"
            )
        return list(self._last_lr)

    def _captured_state(self) -> dict:
        """Values read from the optimizer at construction (not from the config), to be saved."""
        return {}

    def _restore_captured_state(self, state_dict: dict) -> None:
        """Restores what ``_captured_state`` saved, when present (DeepSpeed's lack it)."""

    def state_dict(self) -> dict:
        """DeepSpeed's layout (the batch index), plus values the schedule read from the optimizer.

        The schedule's other parameters come from the config, so a resumed run may change them.
        """
        return {"last_batch_iteration": self.last_batch_iteration, **self._captured_state()}

    def check_state_dict(self, state_dict: dict) -> None:
        """Raises what ``load_state_dict(state_dict)`` would, changing nothing: a checkpoint
        checks every state before it restores any (``load_state_dict`` sets attributes only)."""
        copy.copy(self).load_state_dict(state_dict)

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores the batch index; the next ``step()`` continues from it.

        The optimizer is not written (its own state dict restores its lrs); ``get_last_lr()``
        returns the lrs of the restored batch, the ones the saved run last wrote.
        """
        if "last_batch_iteration" not in state_dict:
            raise ValueError(
                f"{type(self).__name__} state_dict needs the key 'last_batch_iteration', "
                f"got keys {sorted(state_dict)}"
            )
        self.last_batch_iteration = _check_int(
            "state_dict['last_batch_iteration']",
            state_dict["last_batch_iteration"],
            minimum=-1,
        )
        self._restore_captured_state(state_dict)
        self._last_lr = self.get_lr()
