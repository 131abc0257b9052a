"""DeepSpeed's ``deepspeed.runtime.precision_config``: the ``fp16`` / ``bf16`` section classes
(the very classes the config parses those sections into) and their readers."""

from __future__ import annotations

from .config.sections import BF16Config as DeepSpeedBF16Config
from .config.sections import FP16Config as DeepSpeedFP16Config


def get_bfloat16_config(param_dict: dict) -> DeepSpeedBF16Config:
    """The ``bf16`` section (older spelling ``bfloat16``) of a config dict."""
    section = param_dict.get("bf16")
    if section is None:
        section = param_dict.get("bfloat16", {})
    return DeepSpeedBF16Config(**section)


def get_float16_config(param_dict: dict) -> DeepSpeedFP16Config:
    """The ``fp16`` section of a config dict."""
    return DeepSpeedFP16Config(**param_dict.get("fp16", {}))


__all__ = [
    "DeepSpeedBF16Config",
    "DeepSpeedFP16Config",
    "get_bfloat16_config",
    "get_float16_config",
]
