"""The ``scheduler`` section: DeepSpeed's lr schedules, with their arguments and defaults.

Names are case-sensitive, as in DeepSpeed (it looks them up as attributes). DeepSpeed hands any
other name to ``torch.optim.lr_scheduler``; deepspeed_cpp refuses those as "not supported yet"
(a torch scheduler can still be passed to ``initialize(lr_scheduler=...)``).
(No ``from __future__ import annotations``: field types are calls such as ``integer(1)``.)
"""

from typing import Annotated, Any

import torch
from pydantic import Field, PlainValidator, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from .errors import describe_validation_error
from .key_names import model_keys, nearest_key, unknown_key_problem
from .key_policy import policies_under
from .values import ConfigSection, boolean, choice, integer, is_auto, number, number_or_list

_WARMUP_TYPES = ("log", "linear")


def _refuse(message: str):
    raise PydanticCustomError("ds_config_value", "{message}", {"message": message})


class _Schedule(ConfigSection):
    last_batch_iteration: integer(-1) = -1
    """Index of the last batch already trained (-1: start from the beginning)."""


class _WarmupThenTotal(_Schedule):
    """Schedules with a warm-up inside ``total_num_steps``."""

    @model_validator(mode="after")
    def _warmup_fits_in_total(self):
        total, warmup = self.total_num_steps, self.warmup_num_steps
        if not (is_auto(total) or is_auto(warmup)) and total < warmup:
            raise ValueError(
                f"total_num_steps ({total}) must be >= warmup_num_steps ({warmup}): the "
                "schedule would end before its warm-up does"
            )
        return self


class WarmupLRParams(_Schedule):
    warmup_min_lr: number_or_list(0.0) = 0.0
    warmup_max_lr: number_or_list(0.0, optional=True) = None
    """None: the optimizer's lr (DeepSpeed's current default)."""
    warmup_num_steps: integer(1) = 1000
    warmup_type: choice(_WARMUP_TYPES) = "log"


class WarmupDecayLRParams(_WarmupThenTotal):
    total_num_steps: integer(1)
    warmup_min_lr: number_or_list(0.0) = 0.0
    warmup_max_lr: number_or_list(0.0) = 0.001
    warmup_num_steps: integer(1) = 1000
    warmup_type: choice(_WARMUP_TYPES) = "log"


class WarmupCosineLRParams(_WarmupThenTotal):
    total_num_steps: integer(1)
    warmup_min_ratio: number(0.0, 1.0) = 0.0
    warmup_num_steps: integer(1) = 1000
    cos_min_ratio: number(0.0, 1.0) = 0.0001
    warmup_type: choice(_WARMUP_TYPES) = "log"


class OneCycleParams(_Schedule):
    cycle_min_lr: number_or_list(0.0)
    cycle_max_lr: number_or_list(0.0)
    decay_lr_rate: number(0.0) = 0.0
    cycle_first_step_size: integer(1) = 2000
    cycle_second_step_size: integer(1, optional=True) = None
    cycle_first_stair_count: integer() = 0
    cycle_second_stair_count: integer(optional=True) = None
    decay_step_size: integer(0) = 0
    cycle_momentum: boolean() = True
    cycle_min_mom: number_or_list(0.0, 1.0) = 0.8
    cycle_max_mom: number_or_list(0.0, 1.0) = 0.9
    decay_mom_rate: number() = 0.0


class LRRangeTestParams(_Schedule):
    lr_range_test_min_lr: number_or_list(0.0) = 1e-3
    lr_range_test_step_size: integer(1) = 2000
    lr_range_test_step_rate: number(0.0) = 1.0
    lr_range_test_staircase: boolean() = False


PARAMS_BY_TYPE: dict[str, type[ConfigSection]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
    "OneCycle": OneCycleParams,
    "LRRangeTest": LRRangeTestParams,
}
_TORCH_SCHEDULERS = {
    name
    for name, value in vars(torch.optim.lr_scheduler).items()
    if isinstance(value, type) and name[0].isupper() and hasattr(value, "step")
}


def canonical_scheduler_type(value: Any) -> str:
    """The name of a supported schedule; an error saying why for any other."""
    supported = ", ".join(PARAMS_BY_TYPE)
    if not isinstance(value, str):
        _refuse(f"expected the schedule's name as a string, one of {supported}")
    if value in PARAMS_BY_TYPE:
        return value
    if value in _TORCH_SCHEDULERS:
        _refuse(
            f"torch.optim.lr_scheduler.{value} from the config is not supported yet by "
            f"deepspeed_cpp; expected one of {supported}, or build it yourself and pass it to "
            "initialize(lr_scheduler=...)"
        )
    close = nearest_key(value, PARAMS_BY_TYPE)
    hint = f"did you mean '{close}' (names are case-sensitive)? " if close else ""
    _refuse(f"unknown scheduler type; {hint}expected one of {supported}")


class SchedulerConfig(ConfigSection):
    """``scheduler``: ``type`` is DeepSpeed's name ("WarmupLR", ...); ``params`` holds every
    argument of that schedule, DeepSpeed's defaults filled in."""

    type: Annotated[str, PlainValidator(canonical_scheduler_type)]
    params: dict[str, Any] = Field(default_factory=dict)


def validate_scheduler_params(section: Any, known_paths: set[str]) -> tuple[dict | None, list]:
    """Checks the ``params`` of a raw ``scheduler`` object against its type.

    Returns (the params with defaults filled, problems). The params are None when the section
    itself is malformed (not an object, no valid type): ``SchedulerConfig`` says why.
    """
    params = section.get("params", {}) if isinstance(section, dict) else None
    if not isinstance(params, dict):
        return None, []
    try:
        kind = canonical_scheduler_type(section.get("type"))
    except PydanticCustomError:
        return None, []
    model = PARAMS_BY_TYPE[kind]
    try:
        validated = model.model_validate(params)
    except ValidationError as error:
        candidates = model_keys(model) | policies_under("scheduler.params")

        def unknown(loc, value):
            return unknown_key_problem(loc, value, candidates, known_paths)

        return None, describe_validation_error(
            error, ("scheduler", "params"), unknown, f" by {kind}"
        )
    return {name: getattr(validated, name) for name in model.model_fields}, []
