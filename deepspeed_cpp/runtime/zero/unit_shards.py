"""One flat storage for a ZeRO-3 unit's shards, so that gathering the unit sends it as it is.

A unit's gather sends this rank's shard of every parameter of the unit, one after another, and
in a pass that folds the rank agreement into the gathers, a 40-byte header after them
(``pass_agreement.py``). With every parameter's shard in a storage of its own, that row is packed
by a copy of the whole unit before each gather (measured on the issue-27 benchmark's 50M
transformer, 2 ranks: 27-31 ms of a 1.1 s step, ``gather.launch`` in
``benchmarks/zero3_step_profile.py --breakdown``). Here the shards are moved once, at set-up,
into one storage laid out as that row, with room for the header at its end; each parameter's
``ds_tensor`` becomes a view of its place in it. Everything that reads or writes a shard in place
(the optimizer's fp32 masters are the shards themselves, ``store_shard``, checkpoint loading)
goes on working unchanged; a checkpoint writer copies a master that views a larger storage
(``shard_checkpoint_state._bucket_entry``), so the files do not change either.

A unit is left as it is when a shard lives elsewhere (an offload home), its parameters differ in
dtype or device, or a parameter is also in another unit (tied weights: a shard can be in one
storage only). Whatever later replaces a parameter's ``ds_tensor`` (unpartitioning it, a move)
makes ``intact`` false, and the gather packs as before.
"""

from __future__ import annotations

import torch

from . import partition_parameters as pp
from .pass_agreement import header_bytes


class UnitShards:
    """This rank's shards of one unit's parameters in one storage, header room after them."""

    def __init__(self, params: list[torch.nn.Parameter]):
        first = params[0].ds_tensor
        self.dtype, self.device = first.dtype, first.device
        self.numel = sum(p.ds_tensor.numel() for p in params)
        self.data_bytes = self.numel * first.element_size()
        room = -(-header_bytes() // first.element_size())  # whole elements holding the header
        self.storage = torch.empty(self.numel + room, dtype=self.dtype, device=self.device)
        self._addresses = []
        offset = 0
        with torch.no_grad():
            for param in params:
                size = param.ds_tensor.numel()
                view = self.storage.narrow(0, offset, size)
                view.copy_(param.ds_tensor)
                param.ds_tensor = view
                self._addresses.append(view.data_ptr())
                offset += size

    @staticmethod
    def eligible(params: list[torch.nn.Parameter], shared: set[int]) -> bool:
        """Whether ``params`` (a unit's) can move into one storage; ``shared``: ids of the
        parameters that are in more than one unit."""
        if not params:
            return False
        first = params[0].ds_tensor
        return all(
            pp.is_partitioned(p)
            and getattr(p, "ds_home", None) is None
            and id(p) not in shared
            and p.ds_tensor.dtype == first.dtype
            and p.ds_tensor.device == first.device
            and p.ds_tensor.device.type != "meta"
            and p.ds_tensor.dim() == 1
            and p.ds_tensor.is_contiguous()
            for p in params
        )

    def intact(self, params: list[torch.nn.Parameter]) -> bool:
        """Whether ``params`` (the unit's, in order) still keep their shards here."""
        return len(params) == len(self._addresses) and all(
            p.ds_tensor.data_ptr() == address and getattr(p, "ds_home", None) is None
            for p, address in zip(params, self._addresses)
        )

    def row(self, header: torch.Tensor | None) -> torch.Tensor:
        """What this rank sends: the shards, followed by ``header``'s bytes when given (then
        as bytes)."""
        if header is None:
            return self.storage.narrow(0, 0, self.numel)
        raw = self.storage.view(torch.uint8)
        raw[self.data_bytes : self.data_bytes + header_bytes()].copy_(header.view(torch.uint8))
        return raw.narrow(0, 0, self.data_bytes + header_bytes())

    def data(self) -> torch.Tensor:
        """The shards, one after another (1-D, the parameters' dtype)."""
        return self.storage.narrow(0, 0, self.numel)
