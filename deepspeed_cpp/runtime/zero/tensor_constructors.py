"""torch's tensor constructors as ``zero.Init`` re-types them while a model is built.

DeepSpeed's ``zero.Init`` swaps ``torch.tensor``, ``empty``, ``zeros``, ``ones``, ``full``,
``arange``, ``eye`` and ``randn`` for wrappers that put a tensor made without a ``device=`` on the
rank's accelerator and cast a floating-point result to the ZeRO-3 dtype, so that buffers and
temporaries built in ``__init__`` land where and as the partitioned parameters do. transformers
reads this module's names under ``deepspeed.runtime.zero.partition_parameters`` while it builds a
model under a live stage-3 config: its ``prevent_arange_dtype_change`` replaces
``zero_wrapper_for_fp_tensor_constructor`` around ``zero.Init`` (keeping ``torch.arange``'s
explicit integer dtypes for rotary tables) and recognises ``torch.arange`` by identity with
``_orig_torch_arange``. So the wrapper is looked up by name when ``Init`` is entered, and the
originals are the objects torch had when this module was imported.

One difference from DeepSpeed, kept from our ``Init``: with no dtype (no ``dtype=`` and a config
with neither fp16 nor bf16 enabled) floating results keep the dtype they were made with, where
DeepSpeed casts them to fp32 (or fp16 with no config at all).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...accelerator import get_accelerator

# name in torch -> the constructor torch had at import (never one of our wrappers).
ORIGINAL_CONSTRUCTORS: dict[str, Callable] = {
    name: getattr(torch, name)
    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")
}
_orig_torch_tensor = ORIGINAL_CONSTRUCTORS["tensor"]
_orig_torch_empty = ORIGINAL_CONSTRUCTORS["empty"]
_orig_torch_zeros = ORIGINAL_CONSTRUCTORS["zeros"]
_orig_torch_ones = ORIGINAL_CONSTRUCTORS["ones"]
_orig_torch_full = ORIGINAL_CONSTRUCTORS["full"]
_orig_torch_arange = ORIGINAL_CONSTRUCTORS["arange"]
_orig_torch_eye = ORIGINAL_CONSTRUCTORS["eye"]
_orig_torch_randn = ORIGINAL_CONSTRUCTORS["randn"]


def zero_wrapper_for_fp_tensor_constructor(
    fn: Callable,
    target_fp_dtype: torch.dtype | None,
    target_device: torch.device | str | None = None,
) -> Callable:
    """``fn`` (a torch constructor) that, given no ``device=``, makes its tensor on
    ``target_device`` (default: this rank's accelerator) and casts a floating-point result to
    ``target_fp_dtype`` (None: left as made). DeepSpeed's signature, ``target_device`` included
    (transformers reads it back from the keyword arguments)."""

    def wrapped_fn(*args, **kwargs) -> torch.Tensor:
        if kwargs.get("device") is None:
            device = target_device
            if device is None:
                device = get_accelerator().current_device_name()
            kwargs["device"] = torch.device(device)
        tensor = fn(*args, **kwargs)
        if target_fp_dtype is not None and tensor.is_floating_point():
            # .data keeps a tensor made with requires_grad=True a leaf, as DeepSpeed does.
            tensor.data = tensor.data.to(target_fp_dtype)
        return tensor

    wrapped_fn.__wrapped__ = fn
    return wrapped_fn
