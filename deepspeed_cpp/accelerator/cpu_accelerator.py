"""The host as the training device: one "device" per process, gloo for communication."""

from __future__ import annotations

import contextlib
import os

import torch

from . import host_memory
from .abstract_accelerator import DeepSpeedAccelerator
from .host_streams import HOST_DEFAULT_STREAM, HostEvent, HostStream, host_stream_context


class CPUAccelerator(DeepSpeedAccelerator):
    """Runs everything on the host; streams and events are no-ops, memory figures are the RSS."""

    _name = "cpu"
    _communication_backend_name = "gloo"

    def __init__(self) -> None:
        self._resident_peak = host_memory.ResidentPeak()

    # ---- device --------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        # Every local rank shares the one host device, so the index does not change the name.
        return "cpu"

    def device(self, device_index: int | None = None):
        return contextlib.nullcontext()

    def set_device(self, device_index: int) -> None:
        """Nothing to select: every process uses the host."""

    def current_device(self) -> int:
        # A launched rank's "device" is its local slot on the host, as on a GPU node.
        return int(os.environ.get("LOCAL_RANK", 0))

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """Processes meant to share this host (torchrun's ``LOCAL_WORLD_SIZE``), else 1."""
        for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
            value = os.environ.get(name)
            if value and int(value) > 0:
                return int(value)
        return 1

    def synchronize(self, device_index: int | None = None) -> None:
        """Host work is finished when its call returns: nothing to wait for."""

    def is_synchronized_device(self) -> bool:
        return True

    # ---- RNG -----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        return torch.default_generator

    # ---- streams and events --------------------------------------------------------------
    @property
    def Stream(self) -> type:
        return HostStream

    def stream(self, stream):
        return host_stream_context(stream)

    def current_stream(self, device_index: int | None = None):
        return HOST_DEFAULT_STREAM

    def default_stream(self, device_index: int | None = None):
        return HOST_DEFAULT_STREAM

    @property
    def Event(self) -> type:
        return HostEvent

    # ---- memory --------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """The host allocator returns memory to the system on its own."""

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._resident_peak.sample()

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        self._resident_peak.sample()
        return self._resident_peak.peak

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._resident_peak.reset()

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._resident_peak.sample()

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self.max_memory_allocated(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        current = self._resident_peak.sample()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": self._resident_peak.peak,
            "reserved_bytes.all.current": current,
            "reserved_bytes.all.peak": self._resident_peak.peak,
        }

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._resident_peak.reset()

    def total_memory(self, device_index: int | None = None) -> int:
        return host_memory.total_bytes()

    def available_memory(self, device_index: int | None = None) -> int:
        return host_memory.available_bytes()

    # ---- data types ----------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        # torch runs bf16 on every CPU (natively with AVX512-BF16/AMX, through fp32 elsewhere).
        return True

    def is_fp16_supported(self) -> bool:
        # DeepSpeed's CPU accelerator says yes where oneDNN has fp16 kernels for this CPU
        # (AVX512-FP16/AMX-FP16, or torch's own answer for it); scripts and DeepSpeed's tests
        # that pick their precision from this question must pick the same one here.
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except (AttributeError, RuntimeError):  # a torch built without oneDNN
            return False

    # ---- tensors -------------------------------------------------------------------------
    def pin_memory(
        self,
        tensor: torch.Tensor,
        align_bytes: int = 1,
        *,
        make_copy: bool = True,
        match_shape: bool = True,
    ) -> torch.Tensor:
        """``tensor`` itself, unless ``DS_PIN_MEMORY_BACKEND=native`` asks for DeepSpeed's native
        backend: then a page-locked copy (``make_copy``) or allocation, of ``tensor``'s shape
        (``match_shape``) or flat (``deepspeed_cpp.utils.pin_memory``)."""
        from ..utils.pin_memory import get_active_native_pinned_memory

        pins = get_active_native_pinned_memory()
        if pins is not None:
            return pins.pin(tensor, make_copy=make_copy, match_shape=match_shape)
        # torch's pinning only speeds host<->device copies, and there are none; it also needs a
        # CUDA driver, which a CPU-only machine with a CUDA build of torch does not have.
        return tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    # ---- misc ----------------------------------------------------------------------------
    def amp(self):
        return torch.cpu.amp

    @property
    def FloatTensor(self) -> type:
        return torch.FloatTensor

    @property
    def HalfTensor(self) -> type:
        return torch.HalfTensor

    @property
    def BFloat16Tensor(self) -> type:
        return torch.BFloat16Tensor

    @property
    def LongTensor(self) -> type:
        return torch.LongTensor

    @property
    def IntTensor(self) -> type:
        return torch.IntTensor

    @property
    def ByteTensor(self) -> type:
        return torch.ByteTensor

    @property
    def DoubleTensor(self) -> type:
        return torch.DoubleTensor


# DeepSpeed's class name (``from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator``).
CPU_Accelerator = CPUAccelerator
