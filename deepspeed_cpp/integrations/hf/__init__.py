"""The Hugging Face Trainer drop-in: ``from deepspeed_cpp.hf import Trainer, TrainingArguments``.

Scripts written for the Hugging Face Trainer with ``deepspeed=ds_config.json`` (or
``--deepspeed ds_config.json``) train on deepspeed_cpp's engine with that one import changed.
Needs ``transformers`` and ``accelerate`` (``pip install deepspeed_cpp[hf]``).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# The range this integration is tested with at both ends (pyproject.toml's `hf` extra says the
# same); it overrides a few Trainer methods by name.
SUPPORTED = {"transformers": ("5.3.0", "5.25"), "accelerate": ("1.3.0", "1.16")}


def _check_installed() -> None:
    missing, too_old = [], []
    for name, (lowest, _) in SUPPORTED.items():
        try:
            __import__(name)
            found = version(name)
        except (ImportError, PackageNotFoundError):
            missing.append(name)
            continue
        if _as_tuple(found) < _as_tuple(lowest):
            too_old.append(f"{name} {found} (expected >= {lowest})")
    if missing:
        raise ImportError(
            f"deepspeed_cpp.hf needs {' and '.join(missing)}, not importable here: "
            "pip install deepspeed_cpp[hf]"
        )
    if too_old:
        raise ImportError(
            f"deepspeed_cpp.hf needs newer packages: {', '.join(too_old)}; "
            "pip install deepspeed_cpp[hf]"
        )


def _as_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


_check_installed()

from .accelerator import EngineAccelerator, EngineOptimizer, EnginePlan, EngineScheduler  # noqa: E402
from .config_filling import ConfigMismatchError  # noqa: E402
from .pretrained_zero3 import from_pretrained_zero3  # noqa: E402
from .trainer import Seq2SeqTrainer, Trainer  # noqa: E402
from .training_args import Seq2SeqTrainingArguments, TrainingArguments  # noqa: E402
from .zero3_config import (  # noqa: E402
    HfDeepSpeedConfig,
    deepspeed_config,
    initialize_weights_zero3,
    is_deepspeed_zero3_enabled,
)

__all__ = [
    "ConfigMismatchError",
    "EngineAccelerator",
    "EngineOptimizer",
    "EnginePlan",
    "EngineScheduler",
    "HfDeepSpeedConfig",
    "Seq2SeqTrainer",
    "Seq2SeqTrainingArguments",
    "Trainer",
    "TrainingArguments",
    "deepspeed_config",
    "from_pretrained_zero3",
    "initialize_weights_zero3",
    "is_deepspeed_zero3_enabled",
]
