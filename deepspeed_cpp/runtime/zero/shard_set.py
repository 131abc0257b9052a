"""The storage side of a ZeRO stage: what its steppers and its checkpoint state operate on.

A ``ShardSet`` is plain state, made once when the stage is built (``shard_set_builder.py``, over
the stage kind's bucket layout): the trainable parameters in plan order, their bucket plan, the
buckets (the slice of each this rank owns), this rank's fp32 master shards and shard gradients,
and the home the masters and optimizer state live in (the device, the host or NVMe). The lists
are the stage's own: a stepper writing a master writes the stage's master. Nothing here
communicates or steps; the steppers (``steppers.py``, ``offload/stepping.py``) do that, through the
``ParamGathers`` (``param_gathers.py``, ZeRO-3's ``partitioned_buckets.py``) for whatever depends
on how the stage lays its parameters out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ...ops.zero import BucketPlan


@dataclass
class Bucket:
    """The parameters of one bucket and the slice of it this rank owns."""

    params: list[torch.nn.Parameter]
    offsets: list[int]
    size: int
    owned_start: int
    owned_size: int
    gather_dtype: torch.dtype  # the parameters' dtype where they share one, else fp32
    # The flat tensor the parameters view (None where they differ in dtype or device), and the
    # data pointers they had when made views: a mismatch means a parameter's data was replaced.
    flat: torch.Tensor | None = None
    view_pointers: tuple[int, ...] = ()


@dataclass
class ShardSet:
    """Plan, buckets, masters, shard gradients and home of one stage (see the module
    docstring); ``stage``, ``group``, ``rank`` and ``world_size`` say how the buckets are
    sharded."""

    params: list[torch.nn.Parameter]
    plan: BucketPlan
    buckets: list[Bucket]
    masters: list[torch.nn.Parameter]
    shard_grads: list[torch.Tensor]
    home: object  # offload/optimizer_homes.py: DeviceHome, HostHome, NvmeHome or PartialHome
    stage: int
    group: dist.ProcessGroup
    rank: int
    world_size: int

    def link_master_grads(self) -> None:
        """Makes every master's ``.grad`` its shard gradient again. At stage 0 ``initialize``
        hands the torch optimizer itself to the script (as DeepSpeed does); its ``zero_grad()``
        (set_to_none) drops these links, while the reducer keeps writing the shard gradients."""
        for master, grad in zip(self.masters, self.shard_grads):
            if master.grad is not grad:
                master.grad = grad

    def masters_cleared(self) -> bool:
        """Whether a master lost its ``.grad`` link: the script cleared the optimizer
        ``initialize`` handed back, so the last step's gradients are spent."""
        return any(master.grad is None for master in self.masters)

    def sub_group_of(self, bucket: int) -> list[int]:
        """The members of the home's sub-group holding ``bucket``."""
        return next(members for members in self.home.sub_groups if bucket in members)


class ParamGathers(Protocol):
    """What a stepper asks of the stage it steps for: the parts that depend on how the stage
    lays its parameters out (stage 3 keeps a partitioned parameter's shard in its ``ds_tensor``,
    stages 0-2 in flat buckets)."""

    def launch_gather(self, bucket: Bucket, source: torch.Tensor):
        """Starts writing ``source`` (this rank's updated slice of ``bucket``) and the other
        ranks' slices into the bucket's parameters; a pending gather for ``finish_gathers``."""

    def bucket_step_calls(self) -> list[list[int]]:
        """The bucket indices stepped together per optimizer call, when stepping per bucket."""

    def finish_gathers(self, pending) -> None:
        """Waits for gathers ``launch_gather`` started and writes what they brought."""

    def owned_device_target(self, bucket: Bucket) -> torch.Tensor:
        """The device tensor that holds this rank's part of ``bucket``'s parameters."""

    def owned_slice_of_params(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        """The parameters' current values over this rank's slice of ``bucket``, in fp32."""

    def buckets_reduced(self) -> int:
        """How many leading buckets have their shard gradient reduced in this backward."""
