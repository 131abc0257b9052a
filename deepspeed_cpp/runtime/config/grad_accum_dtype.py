"""``data_types.grad_accum_dtype``: the dtype micro-step gradients are accumulated in.

DeepSpeed 0.19.8 (engine ``get_data_types`` / ``_do_optimizer_sanity_check``): unset, it is the
model's dtype (fp16 or bf16 where that section is enabled, else fp32). With ZeRO (stage 1-3) any
of fp16, bf16 and fp32 is accepted and handed to the ZeRO optimizer as the dtype it accumulates
in. Without ZeRO (stage 0) only the model's own dtype is; any other raises NotImplementedError
("unsupported mix of model_dtype and grad_accum_dtype").

deepspeed_cpp's ZeRO stages accumulate every micro-step gradient in fp32 whatever the model's
dtype (fp32 shard gradients at stages 2-3, fp32 accumulators at stages 0-1), so "fp32" is what
they do and is accepted silently, as is the model's own dtype (DeepSpeed's default). A low
precision dtype other than that is accepted with a warning that the accumulation stays in fp32
(more precise than asked; the last bits may differ from DeepSpeed's). Stage 0 refuses the mixes
DeepSpeed refuses, with a NotImplementedError as DeepSpeed raises.
"""

from __future__ import annotations

from typing import Any

from .errors import show
from .values import is_auto

PATH = "data_types.grad_accum_dtype"
# DeepSpeed's DtypeEnum spellings (runtime/config.py), by canonical name.
SPELLINGS = {
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
    "fp32": ("fp32", "float32", "float", "torch.float32"),
}


def _canonical(value: Any) -> str | None:
    for name, spellings in SPELLINGS.items():
        if isinstance(value, str) and value in spellings:
            return name
    return None


def _enabled(config: dict, *sections: str) -> Any:
    for name in sections:
        section = config.get(name)
        if isinstance(section, dict):
            return section.get("enabled", False)
    return False


def _model_dtype(config: dict) -> str | None:
    """fp16, bf16 or fp32 as DeepSpeed derives it from the config; None while "auto"."""
    fp16, bf16 = _enabled(config, "fp16"), _enabled(config, "bf16", "bfloat16")
    if is_auto(fp16) or is_auto(bf16):
        return None
    return "fp16" if fp16 is True else "bf16" if bf16 is True else "fp32"


def _zero_stage(config: dict) -> Any:
    zero = config.get("zero_optimization", {})
    if isinstance(zero, bool):  # DeepSpeed's oldest form: true meant stage 1
        return int(zero)
    return zero.get("stage", 0) if isinstance(zero, dict) else None


def read_grad_accum_dtype(config: dict) -> tuple[list[str], list[str], bool]:
    """Takes ``data_types.grad_accum_dtype`` out of ``config`` (in place) and judges it.

    Returns (problems, warnings, not_implemented): ``not_implemented`` is True when a problem is
    a stage-0 mix that DeepSpeed refuses with NotImplementedError."""
    data_types = config.get("data_types")
    if not isinstance(data_types, dict) or PATH.split(".")[1] not in data_types:
        return [], [], False
    value = data_types.pop("grad_accum_dtype")
    if value is None or is_auto(value):
        return [], [], False  # DeepSpeed's default: the model's dtype; "auto" is filled later
    accum = _canonical(value)
    if accum is None:
        spellings = ", ".join(show(s) for names in SPELLINGS.values() for s in names)
        return [f"{PATH} = {show(value)}: expected null or one of {spellings}"], [], False
    model, stage = _model_dtype(config), _zero_stage(config)
    if model is None or is_auto(stage) or not isinstance(stage, int) or accum == model:
        return [], [], False  # the model's own dtype, or judged once "auto" is filled in
    if stage == 0:
        return (
            [
                f"{PATH} = {show(value)} with a {model} model and no ZeRO (zero_optimization."
                f"stage 0): unsupported mix of model dtype {model} and grad_accum_dtype {accum}, "
                f"as in DeepSpeed (NotImplementedError there too); use ZeRO stage 1-3, or remove "
                f"the key to accumulate in the model's dtype"
            ],
            [],
            True,
        )
    if accum == "fp32":
        return [], [], False  # what every ZeRO stage here does
    return (
        [],
        [
            f"'{PATH}': {show(value)} is accumulated in fp32 by deepspeed_cpp (its ZeRO stages "
            f"accumulate every gradient in fp32; DeepSpeed would accumulate in {accum}, so the "
            f"last bits may differ)"
        ],
        False,
    )
