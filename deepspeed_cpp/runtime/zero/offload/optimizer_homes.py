"""Where a rank's fp32 master shards and optimizer state live: device memory, host memory or NVMe.

The partitioned optimizer keeps one fp32 master ``Parameter`` per bucket and a torch optimizer
over them. A home decides where those tensors are, and the optimizer only ever touches them
inside ``home.resident(sub_group)``:

- ``DeviceHome`` (no offload): masters and state on the training device, always resident;
- ``HostHome`` (``offload_optimizer.device: cpu``): masters, state and a gradient buffer per
  bucket in host memory (page-locked with ``pin_memory``), always resident;
- ``NvmeHome`` (``device: nvme``): each sub-group's masters and state in one swap file; inside
  ``resident`` they are views of one of ``buffer_count`` host buffers, so host memory is bounded
  by the buffers, not the model. With ``pipeline_read`` the next sub-groups are read while this
  one steps; with ``pipeline_write`` a sub-group's write overlaps the next one's step;
- ``PartialHome`` (``ratio`` < 1, ZeRO-Offload++): the first ``ratio`` of the buckets (by
  elements) in a host or NVMe home, the rest on the device, stepped by a device optimizer.

Sub-groups are runs of consecutive buckets of at most ``sub_group_size`` owned elements (a bucket
larger than that is a sub-group of its own): the unit that is swapped and stepped at once.

A step during backward (``backward_steps.py``) is *tentative*: it runs before the step's global
gradient norm is known, so ``resident(..., tentative=True)`` keeps the state from before it until
``commit_tentative()`` (the norm was finite) or ``discard_tentative()`` (it was not: the step is
skipped whole). NVMe writes the new state to the sub-group's other swap file (double-buffered
files: the same reads and writes as an in-place step, no host memory, and for the length of one
step the disk space of the stepped sub-groups twice; the file superseded at commit is removed);
the host home copies what the step overwrites (``host_undo.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch

from .host_heap import return_large_frees_to_the_kernel
from .host_transfer import HostTransfer
from .host_undo import HostUndo
from .swap_errors import SwapFileError

_EMPTY = torch.empty(0)
_REGION_ALIGNMENT = 1024  # elements (4 KiB of fp32): every region starts O_DIRECT-aligned


def plan_sub_groups(owned_sizes: Sequence[int], sub_group_size: int) -> list[list[int]]:
    """Consecutive bucket indices, each run holding at most ``sub_group_size`` elements."""
    groups: list[list[int]] = []
    total = 0
    for bucket, size in enumerate(owned_sizes):
        if groups and total + size <= sub_group_size:
            groups[-1].append(bucket)
            total += size
        else:
            groups.append([bucket])
            total = size
    return groups


class DeviceHome:
    """No offload: masters on the training device, stepped where they are."""

    kind = "none"

    def __init__(self, owned_sizes: Sequence[int]) -> None:
        self.sub_groups = [list(range(len(owned_sizes)))]

    def make_master(self, bucket: int, values: torch.Tensor) -> torch.Tensor:
        return values

    def offloaded(self, bucket: int) -> bool:
        return False

    def attach(self, masters: list[torch.nn.Parameter], optimizer) -> None:
        pass

    def grad_buffer(self, bucket: int) -> torch.Tensor | None:
        return None  # the shard gradient itself is the master's gradient

    @contextlib.contextmanager
    def resident(
        self, sub_group: Sequence[int], write_back: bool = True, tentative: bool = False
    ) -> Iterator[None]:
        """The sub-group's masters and state are valid inside; ``write_back=False``: they are
        only read (NVMe skips writing them back); ``tentative``: a step inside may be undone by
        ``discard_tentative`` (see the module docstring)."""
        if tentative:
            raise RuntimeError(f"{type(self).__name__} cannot step tentatively (no offload)")
        yield

    def commit_tentative(self) -> None:
        """The tentative steps since the last commit or discard are final."""

    def discard_tentative(self) -> None:
        """Puts every sub-group stepped tentatively since the last commit back as it was."""

    def discard_contents(self) -> None:
        """A load is about to replace every master and state: what is stored need not be read
        (NVMe: its swap files may have lost data to a failed write)."""

    def read_ahead_next_step(self) -> None:
        """Starts bringing in what the next step steps first (NVMe only)."""

    def state_outline(self, bucket: int) -> tuple[dict, dict[str, torch.dtype]] | None:
        """For a bucket whose state is in swap files: (its optimizer state that is not
        per-element, the dtype of each per-element entry, in the optimizer's order), known
        without reading the files; None where the state is in memory."""
        return None

    def host_bytes(self) -> int:
        return 0

    def close(self) -> None:
        pass


class HostHome(DeviceHome):
    """``offload_optimizer.device: cpu``: masters, state and gradient buffers on the host."""

    kind = "cpu"

    def __init__(self, owned_sizes: Sequence[int], transfer: HostTransfer, sub_group_size: int):
        self.transfer = transfer
        self.sub_groups = plan_sub_groups(owned_sizes, sub_group_size)
        self._grads = [transfer.host_empty(size) for size in owned_sizes]
        self._masters: list[torch.nn.Parameter] = []
        self._optimizer = None
        self._undo = HostUndo()

    def offloaded(self, bucket: int) -> bool:
        return True

    @contextlib.contextmanager
    def resident(
        self, sub_group: Sequence[int], write_back: bool = True, tentative: bool = False
    ) -> Iterator[None]:
        if tentative:
            self._undo.keep(sub_group, self._masters, self._optimizer)
        yield

    def commit_tentative(self) -> None:
        self._undo.drop()

    def discard_tentative(self) -> None:
        self._undo.restore(self._masters, self._optimizer)

    def make_master(self, bucket: int, values: torch.Tensor) -> torch.Tensor:
        host = self.transfer.host_empty(values.numel())
        self.transfer.to_host(values.detach(), host)
        self.transfer.synchronize()
        return host

    def attach(self, masters: list[torch.nn.Parameter], optimizer) -> None:
        self._masters, self._optimizer = masters, optimizer

    def grad_buffer(self, bucket: int) -> torch.Tensor:
        return self._grads[bucket]

    def host_bytes(self) -> int:
        total = sum(g.numel() * g.element_size() for g in self._grads) + self._undo.host_bytes()
        total += sum(m.numel() * m.element_size() for m in self._masters)
        for master in self._masters:
            # list(): the delayed update's thread may be creating this state right now.
            for value in list(self._optimizer.state.get(master, {}).values()):
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total


class NvmeHome(DeviceHome):
    """``offload_optimizer.device: nvme``: state in swap files, resident in bounded buffers."""

    kind = "nvme"

    def __init__(
        self,
        owned_sizes: Sequence[int],
        transfer: HostTransfer,
        *,
        sub_group_size: int,
        nvme_path: str,
        rank: int,
        aio_config,
        buffer_count: int,
        pipeline_read: bool,
        pipeline_write: bool,
        state_slots: int,
    ) -> None:
        return_large_frees_to_the_kernel()  # else glibc keeps what swapping frees (host_heap.py)
        self.transfer = transfer
        self.owned_sizes = list(owned_sizes)
        self.sub_groups = plan_sub_groups(owned_sizes, sub_group_size)
        self._group_of = {b: g for g, members in enumerate(self.sub_groups) for b in members}
        self.pipeline_read, self.pipeline_write = pipeline_read, pipeline_write
        # Per bucket: master, then `state_slots` per-element state tensors (fp32-sized regions).
        self.state_slots = state_slots
        self._layout = [self._plan_slot(members) for members in self.sub_groups]
        slot_elements = max(total for _, total, _ in self._layout)
        slots = max(1, int(buffer_count)) if (pipeline_read or pipeline_write) else 1
        slots = min(slots, len(self.sub_groups))  # more than one per sub-group buys nothing
        self._slots = [transfer.host_empty(slot_elements, page_aligned=True) for _ in range(slots)]
        self._slot_of: dict[int, int] = {}  # sub-group -> slot holding it (read or being read)
        self._reads: dict[int, object] = {}  # sub-group -> ticket of its read into its slot
        self._writes: dict[int, object] = {}  # slot -> ticket of the write out of it
        self._next_slot = 0
        self._in_use: int | None = None  # the slot of the sub-group inside ``resident``
        from .swap_files import AioSettings, SwapFolder  # the aio op is loaded for NVMe only

        aio = AioSettings.from_config(aio_config)
        self._files = SwapFolder(nvme_path, purpose="optimizer", rank=rank, aio=aio)
        self._written = [False] * len(self.sub_groups)
        # Per sub-group, which of its two swap files holds its committed state (``_key``), and
        # per sub-group stepped tentatively, its buckets' in-memory state from before that step.
        self._version = [0] * len(self.sub_groups)
        self._tentative: dict[int, list[tuple[dict, dict]]] = {}
        # What is not per-element (step counters, hyper-parameter scalars) stays in memory, and
        # the dtype of each per-element state entry (held in an fp32-sized region).
        self._scalars: list[dict] = [{} for _ in owned_sizes]
        self._state_dtypes: list[dict[str, torch.dtype]] = [{} for _ in owned_sizes]
        self._masters: list[torch.nn.Parameter] = []
        self._optimizer = None
        # Masters' first values, held until their sub-group is complete and written.
        self._initial: dict[int, torch.Tensor] = {}

    # --- layout -------------------------------------------------------------------------------
    def _plan_slot(self, members: Sequence[int]) -> tuple[dict[int, int], int, int]:
        """(bucket -> element offset of its master in the slot, slot elements, persisted
        elements): per bucket a master and its state regions, then one gradient region per
        bucket (the gradients are staged through the buffer, never written to the file)."""
        offsets, cursor = {}, 0
        for bucket in members:
            offsets[bucket] = cursor
            cursor += (1 + self.state_slots) * _aligned(self.owned_sizes[bucket])
        persisted = cursor
        for bucket in members:
            cursor += _aligned(self.owned_sizes[bucket])
        return offsets, cursor, persisted

    def _regions(self, group: int, slot: int, bucket: int) -> list[torch.Tensor]:
        """[master, state 0, ..., state K-1] views of ``bucket``'s regions in ``slot``."""
        offsets, _, _ = self._layout[group]
        size, stride = self.owned_sizes[bucket], _aligned(self.owned_sizes[bucket])
        buffer = self._slots[slot]
        return [
            buffer.narrow(0, offsets[bucket] + index * stride, size)
            for index in range(1 + self.state_slots)
        ]

    def _grad_region(self, group: int, slot: int, bucket: int) -> torch.Tensor:
        offsets, _, persisted = self._layout[group]
        cursor = persisted
        for member in self.sub_groups[group]:
            if member == bucket:
                return self._slots[slot].narrow(0, cursor, self.owned_sizes[bucket])
            cursor += _aligned(self.owned_sizes[member])
        raise KeyError(bucket)

    def _persisted(self, group: int, slot: int) -> torch.Tensor:
        return self._slots[slot].narrow(0, 0, self._layout[group][2])

    # --- the optimizer's view -----------------------------------------------------------------
    def offloaded(self, bucket: int) -> bool:
        return True

    def make_master(self, bucket: int, values: torch.Tensor) -> torch.Tensor:
        """Masters are empty placeholders; their values go to the files one sub-group at a
        time, as soon as the sub-group's last bucket arrives (the host never holds more)."""
        host = torch.empty(values.numel())
        self.transfer.to_host(values.detach(), host)
        self._initial[bucket] = host
        group = self._group_of[bucket]
        if bucket == self.sub_groups[group][-1]:
            self.transfer.synchronize()
            slot = self._claim_slot(group)
            for member in self.sub_groups[group]:
                self._regions(group, slot, member)[0].copy_(self._initial.pop(member))
            self._write(group, slot)
        return _EMPTY

    def attach(self, masters: list[torch.nn.Parameter], optimizer) -> None:
        self._masters, self._optimizer = masters, optimizer
        self._finish_writes()

    def grad_buffer(self, bucket: int) -> torch.Tensor:
        group = self._group_of[bucket]
        return self._grad_region(group, self._slot_of[group], bucket)

    @contextlib.contextmanager
    def resident(
        self, sub_group: Sequence[int], write_back: bool = True, tentative: bool = False
    ) -> Iterator[None]:
        group = self._group_of[sub_group[0]]
        if tentative:
            if group in self._tentative:
                raise RuntimeError(
                    f"offload_optimizer.device nvme: sub-group {group} was stepped twice "
                    f"tentatively before the step was committed or discarded"
                )
            # The in-memory part of the state (step counters, which entries exist): what the
            # step replaces in ``_harvest``. The per-element part stays in the committed file.
            self._tentative[group] = [
                (_cloned(self._scalars[bucket]), dict(self._state_dtypes[bucket]))
                for bucket in self.sub_groups[group]
            ]
        slot = self._bring_in(group)
        self._in_use = slot
        # With S slots, one holds this sub-group and one the previous sub-group's write, still
        # in flight: reads go S - 2 ahead now, so that neither waits for that write (which would
        # stall this step); the read into the writing slot starts when this step is done.
        last_ahead = group + len(self._slots) - 1
        if self.pipeline_read:
            for ahead in range(group + 1, min(last_ahead, len(self.sub_groups))):
                self._start_read(ahead)
        state = self._optimizer.state
        for bucket in self.sub_groups[group]:
            regions = self._regions(group, slot, bucket)
            master = self._masters[bucket]
            master.data = regions[0]
            entries = dict(self._scalars[bucket])
            for index, (key, dtype) in enumerate(self._state_dtypes[bucket].items()):
                entries[key] = _typed_view(regions[1 + index], dtype)
            if entries:
                state[master] = entries
        try:
            yield
        finally:
            self.transfer.synchronize()  # copies out of the slot have landed before it is reused
            for bucket in self.sub_groups[group]:
                self._harvest(group, slot, bucket)
            if self.pipeline_read and group < last_ahead < len(self.sub_groups):
                self._start_read(last_ahead)  # the previous write had this whole step to finish
            if write_back:
                self._write(group, slot, tentative=tentative)
            else:
                del self._slot_of[group]  # the file is still current
            self._in_use = None
            if not self.pipeline_write:
                self._finish_writes()

    def _harvest(self, group: int, slot: int, bucket: int) -> None:
        """Moves what the optimizer left in its state for ``bucket`` into the slot (state it
        created or a checkpoint loaded is not yet in the slot's regions) and detaches it."""
        master = self._masters[bucket]
        entries = self._optimizer.state.pop(master, {})
        regions = self._regions(group, slot, bucket)
        scalars, dtypes = {}, {}
        for key, value in entries.items():
            if torch.is_tensor(value) and value.dim() > 0 and value.numel() == master.numel():
                if len(dtypes) == self.state_slots:
                    raise RuntimeError(
                        f"offload_optimizer.device nvme: {type(self._optimizer).__name__} keeps "
                        f"more than {self.state_slots} per-element state tensors per parameter "
                        f"(found '{key}' after {list(dtypes)}); use DeepSpeedCPUAdam, "
                        f"DeepSpeedCPUAdagrad or DeepSpeedCPULion (the config's Adam/AdamW)"
                    )
                if value.element_size() > 4:
                    raise RuntimeError(
                        f"offload_optimizer.device nvme: state '{key}' is {value.dtype}; "
                        f"per-element state of at most 4 bytes per element is supported"
                    )
                target = _typed_view(regions[1 + len(dtypes)], value.dtype)
                if target.data_ptr() != value.data_ptr():
                    target.copy_(value)
                dtypes[key] = value.dtype
            else:
                scalars[key] = value
        self._scalars[bucket], self._state_dtypes[bucket] = scalars, dtypes
        master.data = _EMPTY
        master.grad = None

    # --- slots and files ----------------------------------------------------------------------
    def _claim_slot(self, group: int) -> int:
        """A slot for ``group``: the next in the ring, once its previous write has finished;
        never the resident sub-group's (the ring is out of step with the sub-groups when a
        read-only pass stopped early, as ``first_state`` does, leaving a read ahead behind)."""
        slot = self._next_slot
        if slot == self._in_use and len(self._slots) > 1:
            slot = (slot + 1) % len(self._slots)
        self._next_slot = (slot + 1) % len(self._slots)
        for other, held in list(self._slot_of.items()):
            if held == slot:
                if other in self._reads:  # read ahead but never used: drop it
                    self._reads.pop(other).wait()
                del self._slot_of[other]
        ticket = self._writes.pop(slot, None)
        if ticket is not None:
            ticket.wait()
        self._slot_of[group] = slot
        return slot

    def _start_read(self, group: int) -> None:
        if group in self._slot_of:
            return
        slot = self._claim_slot(group)
        if self._written[group]:
            key = self.committed_key(group)
            self._reads[group] = self._files.read(key, self._persisted(group, slot))

    def _bring_in(self, group: int) -> int:
        self._start_read(group)
        ticket = self._reads.pop(group, None)
        if ticket is not None:
            ticket.wait()
        return self._slot_of[group]

    def committed_key(self, group: int) -> str:
        """The swap file key that holds ``group``'s committed state."""
        return _key(group, self._version[group])

    def _write(self, group: int, slot: int, tentative: bool = False) -> None:
        """Writes the sub-group from ``slot`` to its committed file, or (``tentative``) to its
        other one, leaving the committed file as it was until ``commit_tentative``."""
        version = self._version[group] ^ int(tentative)
        key = _key(group, version)
        self._writes[slot] = self._files.write(key, self._persisted(group, slot))
        if not tentative:
            self._written[group] = True
        del self._slot_of[group]

    def commit_tentative(self) -> None:
        # Called with no transfer of a superseded file in flight (it was read before its step);
        # a tentative write may still be: reads of its key wait for it (``SwapFolder``).
        for group in list(self._tentative):
            superseded = self.committed_key(group)
            self._version[group] ^= 1
            self._written[group] = True
            self._files.remove(superseded)
        self._tentative.clear()

    def discard_tentative(self) -> None:
        # The sub-groups' slots were given up at their tentative write (``_write``), so nothing
        # resident holds the discarded state; ``remove`` waits for a write still in flight.
        for group, saved in self._tentative.items():
            self._files.remove(_key(group, self._version[group] ^ 1))
            for bucket, (scalars, dtypes) in zip(self.sub_groups[group], saved):
                self._scalars[bucket], self._state_dtypes[bucket] = scalars, dtypes
        self._tentative.clear()

    def _finish_writes(self) -> None:
        for slot in list(self._writes):
            self._writes.pop(slot).wait()

    def discard_contents(self) -> None:
        # Reads and writes in flight are waited for, failed ones included (their sub-groups are
        # about to be replaced); no sub-group is then read back before it is written anew.
        for tickets in (self._reads, self._writes):
            for key in list(tickets):
                with contextlib.suppress(SwapFileError):
                    tickets.pop(key).wait()
        self._slot_of.clear()
        self._written = [False] * len(self.sub_groups)
        for group in self._tentative:  # a step that failed part-way: the load replaces it all
            with contextlib.suppress(SwapFileError):
                self._files.remove(_key(group, self._version[group] ^ 1))
        self._tentative.clear()

    def read_ahead_next_step(self) -> None:
        """With ``pipeline_read``: the first sub-groups of the next step are read now, into
        the slots whose writes finish first, so the reads overlap the forward and backward in
        between (the last write stays in flight into the forward too)."""
        if self.pipeline_read:
            for group in range(min(len(self._slots) - 1, len(self.sub_groups))):
                self._start_read(group)

    def state_outline(self, bucket: int) -> tuple[dict, dict[str, torch.dtype]]:
        # Outside ``resident`` everything per-element is in the files (``_harvest``).
        return dict(self._scalars[bucket]), dict(self._state_dtypes[bucket])

    def host_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._slots)

    def disk_bytes(self) -> int:
        return self._files.bytes_on_disk()

    def close(self) -> None:
        for ticket in list(self._reads.values()) + list(self._writes.values()):
            with contextlib.suppress(Exception):
                ticket.wait()
        self._reads.clear()
        self._writes.clear()
        self._files.close()


class PartialHome:
    """``ratio`` < 1: buckets ``offloaded`` (global indices) in ``inner``, the rest on the
    device. Sub-groups are the inner home's (in global indices), then one of the device buckets."""

    def __init__(self, inner, offloaded: Sequence[int], bucket_count: int) -> None:
        self.inner = inner
        self.kind = inner.kind
        self.transfer = inner.transfer
        self._local = {bucket: local for local, bucket in enumerate(offloaded)}
        self.on_device = [b for b in range(bucket_count) if b not in self._local]
        self.sub_groups = [[offloaded[local] for local in group] for group in inner.sub_groups]
        if self.on_device:
            self.sub_groups.append(self.on_device)

    def offloaded(self, bucket: int) -> bool:
        return bucket in self._local

    def make_master(self, bucket: int, values: torch.Tensor) -> torch.Tensor:
        local = self._local.get(bucket)
        if local is None:  # stepped on the device (a parameter shard may live on the host)
            return values.to(self.transfer.device)
        return self.inner.make_master(local, values)

    def attach(self, masters: list[torch.nn.Parameter], optimizer) -> None:
        self.inner.attach([masters[b] for b in self._local], optimizer)

    def grad_buffer(self, bucket: int) -> torch.Tensor | None:
        local = self._local.get(bucket)
        return None if local is None else self.inner.grad_buffer(local)

    def resident(self, sub_group: Sequence[int], write_back: bool = True, tentative=False):
        if not self.offloaded(sub_group[0]):
            if tentative:
                raise RuntimeError("the device part of a partial offload cannot step tentatively")
            return contextlib.nullcontext()
        return self.inner.resident([self._local[b] for b in sub_group], write_back, tentative)

    def commit_tentative(self) -> None:
        self.inner.commit_tentative()

    def discard_tentative(self) -> None:
        self.inner.discard_tentative()

    def read_ahead_next_step(self) -> None:
        self.inner.read_ahead_next_step()

    def discard_contents(self) -> None:
        self.inner.discard_contents()

    def state_outline(self, bucket: int):
        local = self._local.get(bucket)
        return None if local is None else self.inner.state_outline(local)

    def host_bytes(self) -> int:
        return self.inner.host_bytes()

    def close(self) -> None:
        self.inner.close()


def _aligned(elements: int) -> int:
    return max(1, math.ceil(elements / _REGION_ALIGNMENT)) * _REGION_ALIGNMENT


def _typed_view(region: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The first ``region.numel()`` elements of ``dtype`` in an fp32-sized region."""
    if dtype == region.dtype:
        return region
    return region.view(torch.uint8).view(dtype).narrow(0, 0, region.numel())


def _key(group: int, version: int) -> str:
    """The swap file of ``group``'s state: two per sub-group, for tentative steps."""
    return f"subgroup_{group:05d}" + ("" if version == 0 else "_b")


def _cloned(entries: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in entries.items()}
