"""``fp16.auto_cast``'s input cast (DeepSpeed's): the engine's forward hands an fp16 module its
floating-point inputs, however nested, as fp16; integer inputs (token ids, labels) stay."""

from __future__ import annotations

import torch


def cast_floating_to_half(value):
    """``value`` with every floating-point tensor in it (in tuples, lists and dicts) as fp16."""
    if isinstance(value, torch.Tensor):
        return value.half() if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(cast_floating_to_half(item) for item in value)
    if isinstance(value, list):
        return [cast_floating_to_half(item) for item in value]
    if isinstance(value, dict):
        return {key: cast_floating_to_half(item) for key, item in value.items()}
    return value
