"""DeepSpeed's ``deepspeed.runtime.zero.utils`` names scripts use: ``ZeRORuntimeException``,
``is_zero_supported_optimizer``, ``is_zero_param``, ``isinstance_namedtuple``,
``apply_to_tensors_only``."""

from __future__ import annotations

import torch


class ZeRORuntimeException(Exception):
    """DeepSpeed's error class for ZeRO misuse at run time."""


def _supported_optimizers() -> tuple:
    from ...ops.adagrad import DeepSpeedCPUAdagrad
    from ...ops.adam import DeepSpeedCPUAdam, FusedAdam
    from ...ops.lion import DeepSpeedCPULion

    return (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, FusedAdam,
            DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion)  # fmt: skip


def is_zero_supported_optimizer(optimizer) -> bool:
    """Whether ``optimizer``'s exact type is one DeepSpeed lists as tested with ZeRO (a
    subclass is not: its step may read state ZeRO partitions)."""
    return type(optimizer) in _supported_optimizers()


def is_zero_param(parameter) -> bool:
    """Whether ``parameter`` is a ZeRO-3 partitioned parameter (it has ``ds_id``)."""
    return torch.is_tensor(parameter) and hasattr(parameter, "ds_id")


def isinstance_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def apply_to_tensors_only(function, value, warning_msg_fn=None):
    """``function`` applied to every tensor in ``value`` (nested lists, tuples, named tuples,
    dicts); other values returned as they are."""
    if isinstance_namedtuple(value):
        return type(value)(*(apply_to_tensors_only(function, v, warning_msg_fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(apply_to_tensors_only(function, v, warning_msg_fn) for v in value)
    if isinstance(value, dict):
        return {k: apply_to_tensors_only(function, v, warning_msg_fn) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return function(value)
    return value
