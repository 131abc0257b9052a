"""Which accelerator this process uses: ``DS_ACCELERATOR`` when set, else CUDA if it works."""

from __future__ import annotations

import os

import torch

from .abstract_accelerator import DeepSpeedAccelerator
from .cpu_accelerator import CPUAccelerator
from .cuda_accelerator import CUDAAccelerator

SUPPORTED_ACCELERATORS: dict[str, type[DeepSpeedAccelerator]] = {
    "cpu": CPUAccelerator,
    "cuda": CUDAAccelerator,
}

_accelerator: DeepSpeedAccelerator | None = None


def _choose() -> DeepSpeedAccelerator:
    forced = os.environ.get("DS_ACCELERATOR", "").strip()
    if forced:
        if forced not in SUPPORTED_ACCELERATORS:
            raise ValueError(
                f"DS_ACCELERATOR={forced!r} is not supported; expected one of "
                f"{sorted(SUPPORTED_ACCELERATORS)} (or unset to choose automatically)"
            )
        if forced == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(
                "DS_ACCELERATOR='cuda' but torch.cuda.is_available() is False "
                f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
                "unset DS_ACCELERATOR or set it to 'cpu'"
            )
        return SUPPORTED_ACCELERATORS[forced]()
    return CUDAAccelerator() if torch.cuda.is_available() else CPUAccelerator()


def get_accelerator() -> DeepSpeedAccelerator:
    """The accelerator of this process, chosen once on the first call.

    ``DS_ACCELERATOR=cpu|cuda`` forces one; otherwise CUDA is used when
    ``torch.cuda.is_available()`` and the CPU (with gloo) everywhere else.
    """
    global _accelerator
    if _accelerator is None:
        _accelerator = _choose()
    return _accelerator


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one deepspeed_cpp supports (always, since
    ``get_accelerator`` only ever chooses a supported one; DeepSpeed's tests assert it)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATORS


def set_accelerator(accelerator: DeepSpeedAccelerator | None) -> None:
    """Use ``accelerator`` from now on (None: choose again on the next ``get_accelerator()``)."""
    global _accelerator
    if accelerator is not None and not isinstance(accelerator, DeepSpeedAccelerator):
        raise TypeError(
            f"set_accelerator: expected a DeepSpeedAccelerator or None, got "
            f"{type(accelerator).__name__}"
        )
    _accelerator = accelerator
