"""The device interface DeepSpeed training scripts program against (``get_accelerator()``).

Scripts written for DeepSpeed never name ``cuda`` directly: they ask the accelerator for the
device name, the communication backend, the RNG, streams and memory statistics. This base class
fixes that interface; ``CPUAccelerator`` and ``CUDAAccelerator`` implement it. Methods that are
the same on every device (the CPU RNG, host pinning checks, ``lazy_call``) live here.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

import torch


class DeepSpeedAccelerator(abc.ABC):
    """One kind of device: its names, streams, RNG, memory statistics and preferred dtypes."""

    # DeepSpeed's own accelerators expose the device kind as ``_name`` and some library code
    # (integrations, op builders) reads it; keep the attribute for them.
    _name: str
    _communication_backend_name: str

    # ---- device --------------------------------------------------------------------------
    @abc.abstractmethod
    def is_available(self) -> bool:
        """Whether this kind of device can run tensors in this process."""

    @abc.abstractmethod
    def device_name(self, device_index: int | None = None) -> str:
        """The device string for ``tensor.to(...)``: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``."""

    @abc.abstractmethod
    def device(self, device_index: int | None = None):
        """A context manager that makes ``device_index`` current (``torch.cuda.device``)."""

    @abc.abstractmethod
    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's current device."""

    @abc.abstractmethod
    def current_device(self) -> int:
        """The index of this process's current device."""

    def current_device_name(self) -> str:
        """The device string of the current device (``"cpu"``, ``"cuda:N"``)."""
        return self.device_name(self.current_device())

    @abc.abstractmethod
    def device_count(self) -> int:
        """How many devices of this kind this process may use."""

    @abc.abstractmethod
    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for all queued work on the device to finish."""

    def is_synchronized_device(self) -> bool:
        """True where device work completes before the call that queued it returns (CPU)."""
        return False

    def use_host_timers(self) -> bool:
        """Whether wall-clock timers on the host measure device work (true when synchronous)."""
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        """Whether the device orders dependent work itself, so no stream waits are needed."""
        return self.is_synchronized_device()

    def handles_memory_backpressure(self) -> bool:
        """Whether allocations wait for memory on their own instead of needing a flush."""
        return self.is_synchronized_device()

    def visible_devices_envs(self) -> list[str]:
        """Environment variables that restrict which devices a process sees."""
        return []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list) -> None:
        """Write the visible-device variables for a child process into ``current_env``."""
        for name in self.visible_devices_envs():
            current_env[name] = ",".join(str(i) for i in local_accelerator_ids)

    # ---- RNG -----------------------------------------------------------------------------
    def random(self):
        """The module that holds the device's RNG functions (``torch.random`` on the host)."""
        return torch.random

    @abc.abstractmethod
    def manual_seed(self, seed: int) -> None:
        """Seed the current device's generator."""

    @abc.abstractmethod
    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's generator."""

    @abc.abstractmethod
    def initial_seed(self) -> int:
        """The seed the current device's generator started from."""

    @abc.abstractmethod
    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        """The generator state of a device, as a byte tensor."""

    @abc.abstractmethod
    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        """Restore a generator state returned by ``get_rng_state``."""

    @abc.abstractmethod
    def default_generator(self, device_index: int):
        """The ``torch.Generator`` that a device's random functions use by default."""

    # ---- streams and events --------------------------------------------------------------
    # ``Stream``, ``Event`` and the typed-tensor properties keep DeepSpeed's capitalised names.
    @property
    @abc.abstractmethod
    def Stream(self) -> type:
        """The stream class; construct with ``get_accelerator().Stream()``."""

    @abc.abstractmethod
    def stream(self, stream):
        """A context manager that makes ``stream`` current."""

    @abc.abstractmethod
    def current_stream(self, device_index: int | None = None):
        """The stream work is queued on now."""

    @abc.abstractmethod
    def default_stream(self, device_index: int | None = None):
        """The device's default stream."""

    @property
    @abc.abstractmethod
    def Event(self) -> type:
        """The event class; ``Event(enable_timing=True)`` measures time between two records."""

    # ---- memory --------------------------------------------------------------------------
    @abc.abstractmethod
    def empty_cache(self) -> None:
        """Return cached, unused device memory to the system."""

    @abc.abstractmethod
    def memory_allocated(self, device_index: int | None = None) -> int:
        """Bytes in use now."""

    @abc.abstractmethod
    def max_memory_allocated(self, device_index: int | None = None) -> int:
        """Peak bytes in use since the start or the last reset."""

    @abc.abstractmethod
    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        """Start a new peak measurement."""

    @abc.abstractmethod
    def memory_reserved(self, device_index: int | None = None) -> int:
        """Bytes held by the allocator, in use or cached."""

    @abc.abstractmethod
    def max_memory_reserved(self, device_index: int | None = None) -> int:
        """Peak bytes held by the allocator."""

    def memory_cached(self, device_index: int | None = None) -> int:
        """Old name of ``memory_reserved``."""
        return self.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        """Old name of ``max_memory_reserved``."""
        return self.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        """Old name of ``reset_peak_memory_stats``."""
        self.reset_peak_memory_stats(device_index)

    @abc.abstractmethod
    def memory_stats(self, device_index: int | None = None) -> dict:
        """Allocator statistics, with at least ``allocated_bytes.all.current`` and ``.peak``."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        """Start new peak measurements."""

    @abc.abstractmethod
    def total_memory(self, device_index: int | None = None) -> int:
        """The device's capacity in bytes."""

    @abc.abstractmethod
    def available_memory(self, device_index: int | None = None) -> int:
        """Bytes that could still be allocated."""

    # ---- data types ----------------------------------------------------------------------
    @abc.abstractmethod
    def is_bf16_supported(self) -> bool:
        """Whether bfloat16 training is supported and worthwhile here."""

    @abc.abstractmethod
    def is_fp16_supported(self) -> bool:
        """Whether float16 training is supported and worthwhile here."""

    def supported_dtypes(self) -> list[torch.dtype]:
        """The floating-point dtypes training may use here."""
        dtypes = [torch.float32]
        if self.is_bf16_supported():
            dtypes.append(torch.bfloat16)
        if self.is_fp16_supported():
            dtypes.append(torch.float16)
        return dtypes

    # ---- tensors -------------------------------------------------------------------------
    @abc.abstractmethod
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        """A page-locked copy of a host tensor where pinning helps (a no-op on the CPU)."""

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives in page-locked host memory (torch's, or the native
        backend's with ``DS_PIN_MEMORY_BACKEND=native``, views included)."""
        from ..utils.pin_memory import get_active_native_pinned_memory

        pins = get_active_native_pinned_memory()
        if pins is not None and pins.is_pinned(tensor):
            return True
        return tensor.device.type == "cpu" and tensor.is_pinned()

    def unpin_memory(self, tensor: torch.Tensor) -> bool | None:
        """DeepSpeed's release of a natively pinned allocation: with
        ``DS_PIN_MEMORY_BACKEND=native`` True when ``tensor`` was one (False otherwise); torch's
        pinned memory is released with the tensor, so None there, as DeepSpeed returns."""
        from ..utils.pin_memory import get_active_native_pinned_memory

        pins = get_active_native_pinned_memory()
        return pins.unpin(tensor) if pins is not None else None

    @abc.abstractmethod
    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on this kind of device."""

    # ---- communication and misc ----------------------------------------------------------
    def communication_backend_name(self) -> str:
        """The ``torch.distributed`` backend for this device (``"gloo"``, ``"nccl"``)."""
        return self._communication_backend_name

    @abc.abstractmethod
    def amp(self):
        """The autocast module for this device (``torch.cpu.amp``, ``torch.cuda.amp``)."""

    def range_push(self, msg: str) -> None:
        """Open a named profiler range (NVTX on CUDA; nothing where no profiler hooks exist)."""
        return None

    def range_pop(self) -> None:
        """Close the innermost profiler range."""
        return None

    def lazy_call(self, callback: Callable[[], object]):
        """Run ``callback`` once the device is initialised (at once where nothing is lazy)."""
        return callback()

    def is_triton_supported(self) -> bool:
        """Whether Triton kernels can run on this device."""
        return False

    def get_compile_backend(self) -> str:
        """The ``torch.compile`` backend to use here."""
        return "inductor"

    def create_op_builder(self, class_name: str):
        """An instance of the op builder named ``class_name`` (None when there is none)."""
        builder_class = self.get_op_builder(class_name)
        return None if builder_class is None else builder_class()

    def get_op_builder(self, class_name: str):
        """The op builder class named ``class_name`` (e.g. ``"CPUAdamBuilder"``), or None."""
        from ..ops import op_builder

        candidate = getattr(op_builder, class_name, None)
        if isinstance(candidate, type) and issubclass(candidate, op_builder.OpBuilder):
            return candidate
        return None

    # Legacy typed-tensor constructors, still called by older DeepSpeed-era code.
    @property
    @abc.abstractmethod
    def FloatTensor(self) -> type:
        """``torch.FloatTensor`` on this device."""

    @property
    @abc.abstractmethod
    def HalfTensor(self) -> type:
        """``torch.HalfTensor`` on this device."""

    @property
    @abc.abstractmethod
    def BFloat16Tensor(self) -> type:
        """``torch.BFloat16Tensor`` on this device."""

    @property
    @abc.abstractmethod
    def LongTensor(self) -> type:
        """``torch.LongTensor`` on this device."""

    @property
    @abc.abstractmethod
    def IntTensor(self) -> type:
        """``torch.IntTensor`` on this device."""

    @property
    @abc.abstractmethod
    def ByteTensor(self) -> type:
        """``torch.ByteTensor`` on this device."""

    @property
    @abc.abstractmethod
    def DoubleTensor(self) -> type:
        """``torch.DoubleTensor`` on this device."""

    def __repr__(self) -> str:
        backend = self._communication_backend_name
        return f"<{type(self).__name__} device={self._name!r} backend={backend!r}>"
