"""``deepspeed.utils.torch``: the torch-version helpers DeepSpeed code and tests call."""

from __future__ import annotations

import torch
from packaging import version as _version


def required_torch_version(min_version=None, max_version=None) -> bool:
    """Whether the running torch is at least ``min_version`` and at most ``max_version`` (either
    may be omitted, not both; numbers such as ``2.1`` or strings such as ``"2.1.0"``)."""
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give min_version, max_version or both")
    running = _version.parse(torch.__version__.split("+")[0])
    if min_version is not None and running < _version.parse(str(min_version)):
        return False
    if max_version is not None and running > _version.parse(str(max_version)):
        return False
    return True


def register_grad_hook(param: torch.Tensor, hook):
    """Calls ``hook(param)`` once the gradient of ``param`` is accumulated; returns the handle."""
    return param.register_post_accumulate_grad_hook(hook)


def jit_script_compat(fn):
    """DeepSpeed compiles small helpers with this; eager here (torch.compile on first call costs
    seconds for functions that run once per step, and is the user's choice to make)."""
    return fn
