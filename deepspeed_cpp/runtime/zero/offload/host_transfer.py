"""Copies between the training device and host memory: the one place offload meets the device.

On a CUDA device the host side is page-locked (when ``pin_memory``) and copies run on a side
stream, so a bucket's copy overlaps the step of the one before; ``synchronize`` is the one point
where the host waits for them. On the CPU accelerator the "device" is host memory: the same calls
run, each copy is a plain memcpy and the waits return at once, so both run the same engine code.
"""

from __future__ import annotations

import torch

from ....accelerator import get_accelerator

_PAGE = 4096


class HostTransfer:
    """Allocates host buffers and moves tensors between them and ``device``."""

    def __init__(self, device: torch.device, *, pin_memory: bool) -> None:
        self.device = torch.device(device)
        self._accelerator = get_accelerator()
        self._on_host = self.device.type == "cpu"
        self._pin = pin_memory and not self._on_host
        self._stream = None if self._on_host else self._accelerator.Stream()

    def host_empty(
        self, numel: int, dtype: torch.dtype = torch.float32, *, page_aligned: bool = False
    ) -> torch.Tensor:
        """A 1-D host tensor, page-locked when pinning is on and helps. ``page_aligned``: it
        starts on a 4096-byte boundary (O_DIRECT transfers it without a bounce buffer)."""
        if not page_aligned:
            tensor = torch.empty(numel, dtype=dtype)
            return self._accelerator.pin_memory(tensor) if self._pin else tensor
        itemsize = torch.empty(0, dtype=dtype).element_size()
        raw = torch.empty(numel * itemsize + _PAGE, dtype=torch.uint8)
        if self._pin:
            raw = self._accelerator.pin_memory(raw)
        skip = -raw.data_ptr() % _PAGE
        return raw.narrow(0, skip, numel * itemsize).view(dtype)

    def to_host(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Queues ``target.copy_(source)`` (device -> host); visible after ``synchronize``."""
        self._copy(source, target)

    def to_device(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Queues ``target.copy_(source)`` (host -> device), ordered before later device work. A
        dtype change is made on the host first, so that only the target's bytes cross."""
        if self._stream is not None and source.dtype != target.dtype:
            source = source.to(target.dtype)
        self._copy(source, target)
        if self._stream is not None:
            self._accelerator.current_stream().wait_stream(self._stream)

    def synchronize(self) -> None:
        """Waits until every queued copy has landed."""
        if self._stream is not None:
            self._stream.synchronize()

    def _copy(self, source: torch.Tensor, target: torch.Tensor) -> None:
        if self._stream is None:
            target.copy_(source)
            return
        # The side stream must see everything the compute stream did to the source so far.
        self._stream.wait_stream(self._accelerator.current_stream())
        with self._accelerator.stream(self._stream):
            target.copy_(source, non_blocking=self._pin)
