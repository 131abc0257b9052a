"""Where ZeRO-3 parameter shards live between uses with ``offload_param``: host memory or NVMe.

A partitioned parameter adopted by a home keeps ``param.ds_home``; ``partition_parameters``
asks it for the shard when a gather starts (``read_into`` the gather's own slice, on the device)
and gives it updated values after a step (``store``):

- ``HostParamHome`` (``device: cpu``): ``ds_tensor`` is a host tensor (page-locked with
  ``pin_memory``); a gather copies it to the device.
- ``NvmeParamHome`` (``device: nvme``): each shard is a swap file and ``ds_tensor`` a ``meta``
  tensor of the shard's size and dtype (nothing reads it by mistake). Shards pass through
  ``buffer_count`` host buffers of ``buffer_size`` elements: host memory is bounded by them. The
  order in which shards were fetched in the previous pass (forward and backward; ``end_pass``)
  is replayed: after each fetch, the shards that came next are read ahead into free buffers, so
  the stage-3 prefetcher's gathers find them in memory.
"""

from __future__ import annotations

import bisect
import collections

import torch

from .host_heap import return_large_frees_to_the_kernel
from .host_transfer import HostTransfer


class HostParamHome:
    """``offload_param.device: cpu``: shards in host memory."""

    kind = "cpu"

    def __init__(self, transfer: HostTransfer) -> None:
        self.transfer = transfer
        self.device = transfer.device
        self._params: list[torch.nn.Parameter] = []

    def check_fits(self, params) -> None:
        pass

    def adopt(self, param: torch.nn.Parameter) -> None:
        host = self.transfer.host_empty(param.ds_tensor.numel(), param.ds_tensor.dtype)
        self.transfer.to_host(param.ds_tensor, host)
        self.transfer.synchronize()
        param.ds_tensor = host
        param.ds_home = self
        self._params.append(param)

    def read_into(self, param: torch.nn.Parameter, target: torch.Tensor) -> None:
        self.transfer.to_device(param.ds_tensor, target)

    def read(self, param: torch.nn.Parameter) -> torch.Tensor:
        return param.ds_tensor

    def store(self, param: torch.nn.Parameter, values: torch.Tensor) -> None:
        self.transfer.synchronize()  # no copy out of this shard may still be in flight
        param.ds_tensor.copy_(values)

    def end_pass(self) -> None:
        pass

    def read_ahead_first(self) -> None:
        pass

    def host_bytes(self) -> int:
        return sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in self._params)

    def close(self) -> None:
        """Gives the shards back to the device (a later engine may adopt them again)."""
        for param in self._params:
            param.ds_tensor = param.ds_tensor.to(self.device)
            param.ds_home = None
        self._params.clear()


class NvmeParamHome:
    """``offload_param.device: nvme``: shards in swap files, read ahead in the order of use."""

    kind = "nvme"

    def __init__(
        self,
        transfer: HostTransfer,
        *,
        nvme_path: str,
        rank: int,
        aio_config,
        buffer_count: int,
        buffer_size: int,
    ) -> None:
        from .swap_files import AioSettings, SwapFolder

        return_large_frees_to_the_kernel()  # else glibc keeps what swapping frees (host_heap.py)
        self.transfer = transfer
        self.device = transfer.device
        self.buffer_size = int(buffer_size)
        self._files = SwapFolder(
            nvme_path, purpose="param", rank=rank, aio=AioSettings.from_config(aio_config)
        )
        self._buffer_count = max(2, int(buffer_count))
        self._buffers: dict[torch.dtype, list[torch.Tensor]] = {}
        self._free: list[tuple[torch.dtype, int]] = []
        self._reading: dict[int, tuple[tuple, object]] = {}  # ds_id -> (buffer, ticket)
        self._writing: collections.deque = collections.deque()  # (buffer, ticket), oldest first
        self._params: dict[int, torch.nn.Parameter] = {}
        self._order: list[int] = []  # ds_ids in the order the previous pass fetched them
        self._positions: dict[int, list[int]] = {}  # ds_id -> its positions in _order
        self._cursor = 0  # where in _order this pass is (after the last fetch found there)
        self._recording: list[int] = []
        # Fetches that found their shard read ahead, and those that had to read it then.
        self.read_ahead_hits = 0
        self.reads_on_demand = 0

    # --- adoption -----------------------------------------------------------------------------
    def check_fits(self, params) -> None:
        """Raises before anything is adopted when a shard is larger than a buffer."""
        for param in params:
            if param.ds_tensor.numel() > self.buffer_size:
                raise ValueError(
                    f"zero_optimization.offload_param.buffer_size = {self.buffer_size} elements "
                    f"is smaller than the shard of parameter "
                    f"'{getattr(param, 'ds_name', param.ds_id)}' ({param.ds_tensor.numel()} "
                    f"elements); expected a buffer_size of at least the largest shard"
                )

    def adopt(self, param: torch.nn.Parameter) -> None:
        shard = param.ds_tensor
        self.check_fits([param])
        if shard.dtype not in self._buffers:
            self._buffers[shard.dtype] = [
                self.transfer.host_empty(self.buffer_size, shard.dtype, page_aligned=True)
                for _ in range(self._buffer_count)
            ]
            self._free.extend((shard.dtype, index) for index in range(self._buffer_count))
        self._params[param.ds_id] = param
        param.ds_home = self
        self.store(param, shard)
        param.ds_tensor = torch.empty(shard.numel(), dtype=shard.dtype, device="meta")

    # --- reads --------------------------------------------------------------------------------
    def read_into(self, param: torch.nn.Parameter, target: torch.Tensor) -> None:
        """Copies ``param``'s shard into ``target`` (on the device), then reads ahead."""
        buffer, view = self._fetch(param)
        self.transfer.to_device(view, target)
        self.transfer.synchronize()  # the buffer is free again once the copy has landed
        self._free.append(buffer)
        self._recording.append(param.ds_id)
        if len(self._recording) > 4 * len(self._params) + 64:
            # No backward ends the passes (evaluation only): what was fetched so far becomes
            # the order, instead of a recording that grows without bound.
            self.end_pass()
        self._read_ahead(param.ds_id)

    def read(self, param: torch.nn.Parameter) -> torch.Tensor:
        """A host copy of ``param``'s shard."""
        buffer, view = self._fetch(param)
        values = view.clone()
        self._free.append(buffer)
        return values

    def _fetch(self, param: torch.nn.Parameter):
        pending = self._reading.pop(param.ds_id, None)
        if pending is None:
            self.reads_on_demand += 1
            buffer = self._claim(param.ds_tensor.dtype)
            view = self._view(buffer, param)
            self._files.read(_key(param), view).wait()
            return buffer, view
        self.read_ahead_hits += 1
        buffer, ticket = pending
        ticket.wait()
        return buffer, self._view(buffer, param)

    def read_ahead_first(self) -> None:
        """Starts reading the shards the next pass uses first (after a step wrote them)."""
        self._cursor = 0
        # Waiting for the step's writes to free their buffers here (not during the forward).
        self._read_ahead(None, wait=True)

    def _read_ahead(self, ds_id: int | None, wait: bool = False) -> None:
        """Reads ahead what followed this fetch in the previous pass: its next occurrence at or
        after the cursor (a parameter fetched in forward and again in backward is found at the
        right one of its two places)."""
        position = 0
        if ds_id is not None:
            places = self._positions.get(ds_id)
            if not places:
                return
            at = bisect.bisect_left(places, self._cursor)
            position = (places[at] if at < len(places) else places[0]) + 1
            self._cursor = position
        for upcoming in self._order[position : position + self._buffer_count - 1]:
            if upcoming in self._reading:
                continue
            param = self._params[upcoming]
            buffer = self._claim(param.ds_tensor.dtype, wait=wait)
            if buffer is None:
                return
            ticket = self._files.read(_key(param), self._view(buffer, param))
            self._reading[upcoming] = (buffer, ticket)

    def end_pass(self) -> None:
        """The fetches since the last call are the order to read ahead in next time."""
        if self._recording:
            self._order, self._recording = self._recording, []
            self._positions = {}
            for position, ds_id in enumerate(self._order):
                self._positions.setdefault(ds_id, []).append(position)
        self._cursor = 0

    # --- writes -------------------------------------------------------------------------------
    def store(self, param: torch.nn.Parameter, values: torch.Tensor) -> None:
        """Writes ``values`` (any device, cast to the shard's dtype) as ``param``'s shard."""
        stale = self._reading.pop(param.ds_id, None)  # read ahead before this update
        if stale is not None:
            stale[1].wait()
            self._free.append(stale[0])
        buffer = self._claim(param.ds_tensor.dtype)
        view = self._view(buffer, param, values.numel())
        view.copy_(values.detach().reshape(-1))
        self._writing.append((buffer, self._files.write(_key(param), view)))

    # --- buffers ------------------------------------------------------------------------------
    def _claim(self, dtype: torch.dtype, wait: bool = True):
        """A free buffer of ``dtype``: a free one, else the oldest write's once it is done."""
        for index, buffer in enumerate(self._free):
            if buffer[0] == dtype:
                return self._free.pop(index)
        for index, (buffer, ticket) in enumerate(self._writing):
            if buffer[0] == dtype and (wait or ticket.done()):
                del self._writing[index]
                ticket.wait()
                return buffer
        if not wait:
            return None
        # Every buffer holds a read ahead: give up the one needed last.
        for ds_id in reversed(list(self._reading)):
            buffer, ticket = self._reading[ds_id]
            if buffer[0] == dtype:
                del self._reading[ds_id]
                ticket.wait()
                return buffer
        raise RuntimeError(f"NvmeParamHome: no {dtype} buffer free (all {self._buffer_count} busy)")

    def _view(self, buffer, param, numel: int | None = None) -> torch.Tensor:
        dtype, index = buffer
        return self._buffers[dtype][index].narrow(0, 0, numel or param.ds_tensor.numel())

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for group in self._buffers.values() for b in group)

    def disk_bytes(self) -> int:
        return self._files.bytes_on_disk()

    def close(self) -> None:
        """Gives the shards back to the device (a later engine may adopt them again) and
        removes the swap files."""
        try:
            for param in self._params.values():
                values = self.read(param)
                param.ds_tensor = values.to(self.device)
                param.ds_home = None
        finally:
            self._params.clear()
            for _, ticket in list(self._reading.values()) + list(self._writing):
                ticket.wait()
            self._reading.clear()
            self._writing.clear()
            self._files.close()


def _key(param) -> str:
    return f"param_{param.ds_id:07d}"
