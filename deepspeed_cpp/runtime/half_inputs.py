"""Half precision at the module boundary: ``fp16.auto_cast``'s input cast (DeepSpeed's: the
engine's forward hands an fp16 module its floating-point inputs, however nested, as fp16; integer
inputs such as token ids and labels stay) and the cast of a module's parameters (not its
buffers) to the training dtype."""

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


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """fp16/bf16 training at ZeRO 0-2: the module's floating-point parameters in ``dtype``; its
    buffers keep their dtype (``data_types.buffer_dtype`` unset), as DeepSpeed 0.19.8 keeps them,
    so fp32 tables such as rotary embeddings' ``inv_freq`` or normalisation statistics are not
    rounded."""
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)
