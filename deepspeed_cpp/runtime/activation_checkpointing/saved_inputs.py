"""Where a checkpoint keeps the inputs it saves for recomputation: whole, partitioned across the
model-parallel group, in host memory, in preallocated contiguous buffers.

``torch.utils.checkpoint`` (non-reentrant) saves each checkpointed call's inputs through autograd's
saved-tensor mechanism, outside its own hooks; ``SavedInputHooks`` is a pair of
``torch.autograd.graph.saved_tensors_hooks`` placed around the call that sees exactly those
inputs. ``pack`` decides how one input is kept until the backward, ``unpack`` rebuilds it for the
recomputation. Autograd restores the tensor's grad_fn and requires_grad itself, so only the
values travel through here.

Under tensor parallelism the inputs of a checkpointed layer are replicated on every rank of the
model-parallel group; keeping 1/N of each on each rank and all-gathering it back for the
recomputation divides that memory by N (DeepSpeed's ``partition_activations``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class SavedInputStats:
    """What went through the hooks since the last ``reset()`` (the profile log prints it, tests
    read it): inputs packed, of those partitioned and sent through the host path, inputs
    rebuilt, and bytes kept on this rank."""

    packed: int = 0
    partitioned: int = 0
    host_copies: int = 0
    unpacked: int = 0
    kept_bytes: int = 0


@dataclass
class ContiguousBuffers:
    """DeepSpeed's ``contiguous_memory_optimization``: kept partitions are copied into slots of
    flat buffers allocated ``slots`` at a time (``number_checkpoints``: one slot per checkpointed
    call of a forward), one chain of buffers per (numel, dtype, device), instead of as many
    separate allocations. ``release()`` at the start of a backward drops the pool's references;
    the slots still saved stay alive through their views until autograd frees them."""

    slots: int
    _pools: dict = field(default_factory=dict)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (numel, dtype, device)
        buffer, used = self._pools.get(key, (None, self.slots))
        if used == self.slots:
            buffer, used = torch.empty(self.slots * numel, dtype=dtype, device=device), 0
        self._pools[key] = (buffer, used + 1)
        return buffer.narrow(0, used * numel, numel)

    def release(self) -> None:
        self._pools = {}


@dataclass(frozen=True)
class _Kept:
    """One saved input as kept: its values (whole or this rank's padded partition, possibly on
    the host) and what rebuilding it needs."""

    values: torch.Tensor
    shape: torch.Size
    device: torch.device
    partitioned: bool


def is_activation_to_checkpoint(tensor: torch.Tensor, parts: int) -> bool:
    """DeepSpeed's rule for the inputs it partitions or moves: floating point, at least one
    element per part, not marked ``no_checkpointing``. Parameters are left alone: the module
    keeps them alive anyway, so a partitioned or host copy would only add memory and traffic."""
    return (
        tensor.is_floating_point()
        and tensor.numel() >= parts
        and not getattr(tensor, "no_checkpointing", False)
        and not isinstance(tensor, torch.nn.Parameter)
    )


class SavedInputHooks:
    """The pack/unpack pair for one configuration; install with ``hooks.installed()``."""

    def __init__(
        self,
        *,
        group,
        group_rank: int,
        group_size: int,
        to_host: bool,
        buffers: ContiguousBuffers | None,
        stats: SavedInputStats,
    ):
        # Partitioning needs a group of at least two ranks; otherwise inputs are kept whole.
        self.partition = group_size > 1
        self.group, self.rank, self.size = group, group_rank, group_size
        self.to_host = to_host
        self.buffers = buffers if self.partition else None
        self.stats = stats

    def installed(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor):
        self.stats.packed += 1
        if not is_activation_to_checkpoint(tensor, self.size if self.partition else 1):
            return tensor
        values = tensor.detach()
        if self.partition:
            values = self._my_partition(values)
            self.stats.partitioned += 1
        if self.to_host:
            values = self._on_host(values)
            self.stats.host_copies += 1
        self.stats.kept_bytes += values.numel() * values.element_size()
        return _Kept(values, tensor.shape, tensor.device, self.partition)

    def unpack(self, kept) -> torch.Tensor:
        if not isinstance(kept, _Kept):
            return kept
        self.stats.unpacked += 1
        if self.buffers is not None:
            # The backward has begun: this forward's slots are all taken; the next forward
            # starts fresh buffers (the saved views keep these alive as long as needed).
            self.buffers.release()
        values = kept.values.to(kept.device, non_blocking=True)
        if kept.partitioned:
            values = self._gathered(values, kept.shape)
        return values.view(kept.shape)

    def _my_partition(self, values: torch.Tensor) -> torch.Tensor:
        """This rank's share of the flattened tensor, zero-padded at the end so that every rank
        keeps the same number of elements (DeepSpeed requires divisibility; padding lifts it)."""
        flat = values.reshape(-1)
        share = math.ceil(flat.numel() / self.size)
        start = min(self.rank * share, flat.numel())
        mine = flat[start : start + share]
        if self.buffers is not None:
            kept = self.buffers.take(share, flat.dtype, flat.device)
        else:
            kept = torch.empty(share, dtype=flat.dtype, device=flat.device)
        kept[: mine.numel()].copy_(mine)
        kept[mine.numel() :].zero_()
        return kept

    def _gathered(self, mine: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        full = torch.empty(mine.numel() * self.size, dtype=mine.dtype, device=mine.device)
        dist.all_gather(list(full.chunk(self.size)), mine, group=self.group)
        return full[: shape.numel()]

    @staticmethod
    def _on_host(values: torch.Tensor) -> torch.Tensor:
        """A host copy (pinned, asynchronous) of a device tensor; a host tensor is already there.
        The copy back runs on the same stream, after this one, so no synchronization is needed."""
        if values.device.type == "cpu":
            return values
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        return host
