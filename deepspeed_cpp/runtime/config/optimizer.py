"""The ``optimizer`` section: its type, and its ``params`` checked against that type.

DeepSpeed matches the names of its own optimizers case-insensitively and hands any other name
to ``torch.optim``. deepspeed_cpp builds Adam, AdamW, Lion and SGD from the config; the rest are
refused as "not supported yet" (a torch optimizer can still be passed to ``initialize``).

DeepSpeed's "Adam" has ``adam_w_mode`` (default true): "Adam" with weight decay is AdamW unless
``adam_w_mode`` is false; "AdamW" is AdamW whatever ``adam_w_mode`` says. The validated params
always carry the effective ``adam_w_mode``, so the engine has one thing to read.
(No ``from __future__ import annotations``: field types are calls such as ``number(0.0)``.)
"""

from typing import Annotated, Any

import torch
from pydantic import Field, PlainValidator, ValidationError, model_validator
from pydantic_core import PydanticCustomError

from .errors import describe_validation_error
from .key_names import model_keys, nearest_key, unknown_key_problem
from .key_policy import policies_under
from .values import ConfigSection, adam_betas, boolean, is_auto, number

# Canonical (lower-case) name -> DeepSpeed's spelling.
SUPPORTED_OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "lion": "Lion", "sgd": "SGD"}
_DEEPSPEED_NOT_YET = "Adagrad Lamb OneBitAdam ZeroOneAdam OneBitLamb MuAdam MuAdamW MuSGD Muon"
_DEEPSPEED_OPTIMIZERS_NOT_YET = {name.lower(): name for name in _DEEPSPEED_NOT_YET.split()}
_TORCH_OPTIMIZERS = {
    name.lower(): name
    for name, value in vars(torch.optim).items()
    if isinstance(value, type) and issubclass(value, torch.optim.Optimizer) and name != "Optimizer"
}
_SUPPORTED_TEXT = ", ".join(SUPPORTED_OPTIMIZERS.values())


def _refuse(message: str):
    raise PydanticCustomError("ds_config_value", "{message}", {"message": message})


def canonical_optimizer_type(value: Any) -> str:
    """The lower-case name of a supported optimizer; an error saying why for any other."""
    if not isinstance(value, str):
        _refuse(f"expected the optimizer's name as a string, one of {_SUPPORTED_TEXT}")
    key = value.lower()
    if key in SUPPORTED_OPTIMIZERS:
        return key
    if key in _DEEPSPEED_OPTIMIZERS_NOT_YET:
        _refuse(
            f"DeepSpeed's {_DEEPSPEED_OPTIMIZERS_NOT_YET[key]} optimizer is not supported yet by "
            f"deepspeed_cpp; expected one of {_SUPPORTED_TEXT} (any torch.optim optimizer can be "
            "passed to initialize(optimizer=...) instead)"
        )
    if value in _TORCH_OPTIMIZERS.values():  # DeepSpeed looks these up case-sensitively
        _refuse(
            f"torch.optim.{value} from the config is not supported yet by deepspeed_cpp; expected "
            f"one of {_SUPPORTED_TEXT}, or build torch.optim.{value} yourself and pass it to "
            "initialize(optimizer=...)"
        )
    names = [*SUPPORTED_OPTIMIZERS.values(), *_DEEPSPEED_OPTIMIZERS_NOT_YET.values()]
    close = nearest_key(value, [*names, *_TORCH_OPTIMIZERS.values()])
    hint = f"did you mean '{close}'? " if close else ""
    _refuse(f"unknown optimizer type; {hint}expected one of {_SUPPORTED_TEXT}")


class AdamParams(ConfigSection):
    """``params`` of "Adam" and "AdamW" (DeepSpeed's FusedAdam/CPUAdam arguments)."""

    lr: number(minimum=0.0) = 1e-3
    betas: adam_betas() = (0.9, 0.999)
    eps: number(minimum=0.0) = 1e-8
    weight_decay: number(minimum=0.0) = 0.0
    bias_correction: boolean() = True
    adam_w_mode: boolean() = True
    """Decoupled weight decay (AdamW); false: L2 added to the gradient (classic Adam)."""
    torch_adam: boolean() = False
    """Use torch's Adam/AdamW instead of deepspeed_cpp's kernels."""


class LionParams(ConfigSection):
    """``params`` of "Lion" (DeepSpeed's DeepSpeedCPULion/FusedLion arguments)."""

    lr: number(minimum=0.0) = 1e-3
    betas: adam_betas() = (0.9, 0.999)
    weight_decay: number(minimum=0.0) = 0.0


class SGDParams(ConfigSection):
    """``params`` of "SGD" (torch.optim.SGD's arguments)."""

    lr: number(minimum=0.0) = 1e-3
    momentum: number(minimum=0.0) = 0.0
    dampening: number() = 0.0
    weight_decay: number(minimum=0.0) = 0.0
    nesterov: boolean() = False

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self):
        if self.nesterov is True and not any(map(is_auto, (self.momentum, self.dampening))):
            if not (self.momentum > 0 and self.dampening == 0):
                raise ValueError(
                    f"nesterov: true needs momentum > 0 and dampening = 0, got momentum "
                    f"{self.momentum} and dampening {self.dampening}"
                )
        return self


PARAMS_BY_TYPE: dict[str, type[ConfigSection]] = {
    "adam": AdamParams,
    "adamw": AdamParams,
    "lion": LionParams,
    "sgd": SGDParams,
}


class OptimizerConfig(ConfigSection):
    """``optimizer``: ``type`` is the canonical lower-case name ("adam", "adamw", "sgd");
    ``params`` holds every argument of that type, DeepSpeed's defaults filled in."""

    type: Annotated[str, PlainValidator(canonical_optimizer_type)]
    params: dict[str, Any] = Field(default_factory=dict)


def validate_optimizer_params(
    section: Any, known_paths: set[str]
) -> tuple[dict | None, list, list]:
    """Checks the ``params`` of a raw ``optimizer`` object against its type.

    Returns (the params with defaults filled, problems, warnings). The params are None when the
    section itself is malformed (not an object, no valid type): ``OptimizerConfig`` says why.
    """
    params = section.get("params", {}) if isinstance(section, dict) else None
    if not isinstance(params, dict):
        return None, [], []
    try:
        kind = canonical_optimizer_type(section.get("type"))
    except PydanticCustomError:
        return None, [], []
    model = PARAMS_BY_TYPE[kind]
    try:
        validated = model.model_validate(params)
    except ValidationError as error:
        candidates = model_keys(model) | policies_under("optimizer.params")

        def unknown(loc, value):
            return unknown_key_problem(loc, value, candidates, known_paths)

        context = f" by the {SUPPORTED_OPTIMIZERS[kind]} optimizer"
        return None, describe_validation_error(error, ("optimizer", "params"), unknown, context), []
    warnings = []
    values = {name: getattr(validated, name) for name in model.model_fields}
    if kind == "adamw":
        if values["adam_w_mode"] is False:
            warnings.append(
                "'optimizer.params.adam_w_mode': false is ignored for type AdamW, which always "
                "decays weights decoupled (as in DeepSpeed); use type Adam for L2 weight decay"
            )
        values["adam_w_mode"] = True
    return values, [], warnings
