"""The ``offload_optimizer`` and ``offload_param`` settings, and the homes they pick."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .host_transfer import HostTransfer
from .optimizer_homes import DeviceHome, HostHome, NvmeHome, PartialHome
from .param_homes import HostParamHome, NvmeParamHome


@dataclass(frozen=True)
class OptimizerOffload:
    """``zero_optimization.offload_optimizer`` (with ``sub_group_size`` and the ``aio`` section)."""

    device: str = "none"  # "none", "cpu" or "nvme"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    pipeline_read: bool = False
    pipeline_write: bool = False
    sub_group_size: int = 1_000_000_000
    ratio: float = 1.0  # the share of the state offloaded (ZeRO-Offload++); the rest stays
    aio_config: Any = None  # the config's ``aio`` section (None: its defaults)
    # deepspeed_cpp's delayed parameter update: None (off) or the number of ordinary steps first
    delayed_update_after: int | None = None
    # deepspeed_cpp's extension: step each sub-group during backward once its buckets are
    # reduced. True: asked for (what excludes it is an error); None: wherever this optimizer
    # can (the config's unset default for NVMe); False: off.
    step_during_backward: bool | None = False

    @classmethod
    def from_config(
        cls, zero, aio_config=None, step_during_backward: bool | None = False
    ) -> OptimizerOffload | None:
        """None when the config offloads nothing; ``step_during_backward`` as resolved by
        ``DeepSpeedConfig.step_during_backward_setting()``."""
        part = zero.offload_optimizer
        if part is None or part.device == "none" or part.ratio == 0.0:
            return None
        return cls(
            device=part.device,
            nvme_path=part.nvme_path,
            pin_memory=part.pin_memory,
            buffer_count=part.buffer_count,
            pipeline_read=part.pipeline_read,
            pipeline_write=part.pipeline_write,
            sub_group_size=int(zero.sub_group_size),
            ratio=float(part.ratio),
            aio_config=aio_config,
            delayed_update_after=(
                part.delayed_param_update_warmup_steps if part.delayed_param_update else None
            ),
            step_during_backward=step_during_backward,
        )

    def make_home(
        self, owned_sizes: Sequence[int], device: torch.device, *, rank: int, state_slots: int
    ):
        if self.device == "none":
            return DeviceHome(owned_sizes)
        offloaded = _first_share(owned_sizes, self.ratio) if self.ratio < 1.0 else None
        if offloaded == []:
            return DeviceHome(owned_sizes)
        if offloaded is not None and len(offloaded) < len(owned_sizes):
            inner = self._full_home([owned_sizes[b] for b in offloaded], device, rank, state_slots)
            return PartialHome(inner, offloaded, len(owned_sizes))
        return self._full_home(owned_sizes, device, rank, state_slots)

    def _full_home(self, owned_sizes, device, rank: int, state_slots: int):
        transfer = HostTransfer(device, pin_memory=self.pin_memory)
        if self.device == "cpu":
            return HostHome(owned_sizes, transfer, self.sub_group_size)
        return NvmeHome(
            owned_sizes,
            transfer,
            sub_group_size=self.sub_group_size,
            nvme_path=self.nvme_path,
            rank=rank,
            aio_config=self.aio_config,
            buffer_count=self.buffer_count,
            pipeline_read=self.pipeline_read,
            pipeline_write=self.pipeline_write,
            state_slots=state_slots,
        )


def _first_share(owned_sizes: Sequence[int], ratio: float) -> list[int]:
    """The first buckets holding ``ratio`` of the elements (at least one when ratio > 0)."""
    target, total, chosen = ratio * sum(owned_sizes), 0, []
    for bucket, size in enumerate(owned_sizes):
        if total >= target or ratio == 0.0:
            break
        chosen.append(bucket)
        total += size
    return chosen


@dataclass(frozen=True)
class ParamOffload:
    """``zero_optimization.offload_param`` (ZeRO stage 3)."""

    device: str
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    aio_config: Any = None

    @classmethod
    def from_config(cls, zero, aio_config=None) -> ParamOffload | None:
        part = zero.offload_param
        if part is None or part.device == "none" or zero.stage != 3:
            return None
        return cls(
            device=part.device,
            nvme_path=part.nvme_path,
            pin_memory=part.pin_memory,
            buffer_count=part.buffer_count,
            buffer_size=part.buffer_size,
            aio_config=aio_config,
        )

    def make_home(self, device: torch.device, *, rank: int):
        transfer = HostTransfer(device, pin_memory=self.pin_memory)
        if self.device == "cpu":
            return HostParamHome(transfer)
        return NvmeParamHome(
            transfer,
            nvme_path=self.nvme_path,
            rank=rank,
            aio_config=self.aio_config,
            buffer_count=self.buffer_count,
            buffer_size=self.buffer_size,
        )
