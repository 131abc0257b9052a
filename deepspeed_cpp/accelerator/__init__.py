"""The device abstraction DeepSpeed scripts use: ``from deepspeed_cpp.accelerator import
get_accelerator``, then ``get_accelerator().device_name(local_rank)`` and friends."""

from .abstract_accelerator import DeepSpeedAccelerator
from .cpu_accelerator import CPUAccelerator
from .cuda_accelerator import CUDAAccelerator
from .real_accelerator import (
    SUPPORTED_ACCELERATORS,
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = [
    "SUPPORTED_ACCELERATORS",
    "CPUAccelerator",
    "CUDAAccelerator",
    "DeepSpeedAccelerator",
    "get_accelerator",
    "is_current_accelerator_supported",
    "set_accelerator",
]
