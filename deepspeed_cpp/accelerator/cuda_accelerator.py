"""NVIDIA GPUs through ``torch.cuda``: one device per local rank, NCCL for communication."""

from __future__ import annotations

import torch

from .abstract_accelerator import DeepSpeedAccelerator


class CUDAAccelerator(DeepSpeedAccelerator):
    """Thin forwarding to ``torch.cuda``; device indices are local (``cuda:N``)."""

    _name = "cuda"
    _communication_backend_name = "nccl"

    # ---- device --------------------------------------------------------------------------
    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None):
        return torch.cuda.device(device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]

    # ---- RNG -----------------------------------------------------------------------------
    def random(self):
        return torch.cuda.random

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index]

    # ---- streams and events --------------------------------------------------------------
    @property
    def Stream(self) -> type:
        return torch.cuda.Stream

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> type:
        return torch.cuda.Event

    # ---- memory --------------------------------------------------------------------------
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        index = torch.cuda.current_device() if device_index is None else device_index
        return torch.cuda.get_device_properties(index).total_memory

    def available_memory(self, device_index: int | None = None) -> int:
        free_bytes, _ = torch.cuda.mem_get_info(device_index)
        return free_bytes

    # ---- data types ----------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        # fp16 training pays off with tensor cores (compute capability 7.0, Volta, and newer).
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        return major >= 7

    # ---- tensors -------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory()

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    # ---- misc ----------------------------------------------------------------------------
    def amp(self):
        return torch.cuda.amp

    def range_push(self, msg: str) -> None:
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self) -> None:
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback)

    def is_triton_supported(self) -> bool:
        if not torch.cuda.is_available():
            return False
        major, _ = torch.cuda.get_device_capability()
        return major >= 7

    @property
    def FloatTensor(self) -> type:
        return torch.cuda.FloatTensor

    @property
    def HalfTensor(self) -> type:
        return torch.cuda.HalfTensor

    @property
    def BFloat16Tensor(self) -> type:
        return torch.cuda.BFloat16Tensor

    @property
    def LongTensor(self) -> type:
        return torch.cuda.LongTensor

    @property
    def IntTensor(self) -> type:
        return torch.cuda.IntTensor

    @property
    def ByteTensor(self) -> type:
        return torch.cuda.ByteTensor

    @property
    def DoubleTensor(self) -> type:
        return torch.cuda.DoubleTensor


# DeepSpeed's class name (``from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator``).
CUDA_Accelerator = CUDAAccelerator
