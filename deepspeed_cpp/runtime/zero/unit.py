"""A ZeRO-3 fetch unit: the partitioned parameters one module (or a leaf module's subtree) needs,
gathered with one collective instead of one per parameter.

Every parameter keeps its own padded shard (``ds_tensor``: the layout the optimizer, offload homes
and checkpoints rely on), most units' shards side by side in one storage of the unit's
(``unit_shards.py``, with room for the agreement's header after them). ``unshard`` all-gathers
the unit's shards once into one buffer laid out rank by rank, sending straight from that storage
(else packing this rank's shards into its row of the receive buffer first); ``wait`` copies each
parameter's pieces out of it into the parameter's whole tensor (``ds_whole``, whose storage is
kept for the parameter's lifetime and emptied on release, so the views autograd saved stay
valid) and frees the gathered buffer. A unit of one parameter gathers straight into its whole
tensor, no copy.

On gloo the shards are exchanged in place instead of through gloo's all-gather (which copies
through a freshly allocated flat tensor): one all-to-all between 2 ranks, one broadcast per rank
among more (``shard_gather.py``); this rank's row is then copied out of the unit's storage, not
received. Other backends use their all-gather. Measured on the issue-27 benchmark's transformer,
2 ranks, broadcasts and the storage together: ZeRO-3's step 1.14x -> 1.09x our ZeRO-2's
(``benchmarks/results/zero3_step_s10.txt``).

The copy-out is what FSDP2's ``FSDPParamGroup`` does too (per-parameter shards, one all-gather
per group): it trades one memory pass over the unit for one collective per unit, and on every
backend a collective's launch costs more than copying a module's parameters.

Units prefetched together share one all-gather up to the prefetch bucket size
(``unshard_together``).

A parameter that is already whole or in flight (tied to another unit, held by
``GatheredParameters``) is only counted as held, not gathered again: every rank holds the same
parameters at the same point of a pass (the ranks agree on the uses: ``pass_agreement.py``), so
every rank gathers the same set in the same order. In a pass that folds that agreement into the
gathers, each all-gather carries a 40-byte header after this rank's shards (and so goes through
the copy-out even for one parameter), compared on every rank before the wait for it returns.

Gradients are reduced per unit too: stage 3's ``PartitionedBuckets`` layout hands the C++
reducer a unit's parameters as one bucket laid out rank by rank (the layout ``unshard``
gathers), so one reduce-scatter leaves this rank's piece of every parameter in the unit's flat
shard gradient, while masters and optimizer state stay per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from . import partition_parameters as pp
from .gather_buffers import GatherBuffers
from .pass_agreement import header_bytes, read_headers
from .shard_gather import gathers_by_exchange, launch_all_gather
from .unit_shards import UnitShards


class ZeroUnit:
    """The partitioned parameters of one fetch unit (``name``: the module's, for messages)."""

    def __init__(self, params: list[torch.nn.Parameter], name: str):
        self.params = params
        self.name = name
        self.shards: UnitShards | None = None  # set by ``keep_shards_together``

    def keep_shards_together(self, shared: set[int]) -> None:
        """Moves this rank's shards into one storage (``unit_shards.py``) where the unit allows
        it (``shared``: ids of parameters in more than one unit), so a gather of the whole unit
        sends them without packing."""
        if UnitShards.eligible(self.params, shared):
            self.shards = UnitShards(self.params)

    def __iter__(self):
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def padded_numel(self, world_size: int) -> int:
        return sum(pp.padded_numel(p.ds_numel, world_size) for p in self.params)

    def unshard(self, group) -> None:
        """Starts gathering the unit's parameters (one collective per dtype among those not yet
        whole; one in practice) and counts one more holder of each."""
        unshard_together([self], group, bucket_numel=0)

    def wait(self) -> None:
        """Waits for the unit's gathers: afterwards every parameter is whole."""
        inflight = pp.ZeroParamStatus.INFLIGHT
        for param in self.params:
            if param.ds_status is inflight:  # a held unit (most uses) calls nothing
                pp.wait_gather(param)

    def reshard(self) -> None:
        """Lets go of the unit's parameters (each freed when its last holder lets go)."""
        for param in self.params:
            pp.release(param)


def unshard_together(
    units: list[ZeroUnit],
    group,
    bucket_numel: int,
    agreement=None,
    use: int = -1,
    buffers: GatherBuffers | None = None,
) -> None:
    """Starts gathering several units (the prefetches the schedule launches at one use) with as
    few collectives as their sizes allow: consecutive units share one all-gather up to
    ``bucket_numel`` shard elements per rank (``stage3_prefetch_bucket_size`` / world size), a
    unit never split across two. On a model of many small blocks a collective costs its launch,
    not its bytes, so this is what brings a deep model's gathers from one per block to a few per
    pass (DeepSpeed coalesces its prefetch bucket the same way). Memory: the send and receive
    buffers of one collective (at most ``bucket_numel`` times world size, or one unit), handed
    back to ``buffers`` (``gather_buffers.py``: kept for the next gather of that size) or freed
    once its parameters are copied out; the schedule already counted the units as live.

    ``agreement`` (the coordinator's ``PassAgreement``, at a use of unit ``use``) decides whether
    each all-gather carries a header (``pass_agreement.py``) and hears of it as it lands."""
    world = dist.get_world_size(group) if group is not None else 1
    # Per (dtype, device): the collectives being packed, each [parameters, size, units].
    packs: dict[tuple, list[list]] = {}
    for unit in units:
        todo: dict[tuple, list[torch.nn.Parameter]] = {}
        for param in unit.params:
            if pp.claim(param):
                key = (param.ds_tensor.dtype, pp.device_of(param))
                todo.setdefault(key, []).append(param)
        for key, params in todo.items():
            size = sum(p.ds_tensor.numel() for p in params)
            open_packs = packs.setdefault(key, [])
            if open_packs and open_packs[-1][1] + size <= bucket_numel:
                open_packs[-1][0] = open_packs[-1][0] + params
                open_packs[-1][1] += size
                open_packs[-1][2].append(unit)
            else:
                open_packs.append([params, size, [unit]])
    collectives = [pack for open_packs in packs.values() for pack in open_packs]
    if world == 1:
        for params, _size, _units in collectives:
            for param in params:
                pp.start_gather(param, group)
        return
    headers = None
    if agreement is not None and collectives:
        layouts = [(_data_bytes(params), pp.device_of(params[0])) for params, *_ in collectives]
        headers = agreement.headers_for(layouts, use)
    for index, (params, _size, packed_units) in enumerate(collectives):
        # One whole unit whose shards are still together: sent from there, nothing packed.
        # (The collective's parameters are the unit's claimed ones, in order: the same list
        # when none was already whole or in flight. Not ``==``: that compares tensors.)
        only = packed_units[0] if len(packed_units) == 1 else None
        whole_unit = only is not None and len(params) == len(only.params)
        shards = only.shards if whole_unit else None
        if shards is not None and not shards.intact(params):
            shards = None
        if headers is None:
            _FlatGather(params, group, world, buffers=buffers, shards=shards).launch()
        else:
            gather = _FlatGather(params, group, world, headers[index], agreement, buffers, shards)
            gather.launch()
            agreement.launched(gather)


def _data_bytes(params: list[torch.nn.Parameter]) -> int:
    return sum(p.ds_tensor.numel() for p in params) * params[0].ds_tensor.element_size()


class _FlatGather:
    """One all-gather of several parameters' shards; ``finish`` (reached through any of them,
    ``pp.wait_gather``) makes all of them whole."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group,
        world: int,
        header=None,
        agreement=None,
        buffers: GatherBuffers | None = None,
        shards: UnitShards | None = None,
    ):
        """``header``: int64 values sent after this rank's data and compared on every rank by
        ``agreement.landed`` once the gather landed (``pass_agreement.py``). ``shards``: where
        ``params`` (one whole unit) keep their shards together, sent from there."""
        self.params = params
        self.shards = shards
        self.own_from_shards = False  # whether this rank's row is read from ``shards``
        self.group = group
        self.world = world
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.header = header
        self.agreement = agreement
        self.works = None
        self.gathered = None
        self.buffers = buffers

    def _buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if self.buffers is None:
            return torch.empty(numel, dtype=dtype, device=device)
        return self.buffers.take(numel, dtype, device)

    def launch(self) -> None:
        rank = dist.get_rank(self.group)
        first = self.params[0]
        dtype, device = first.ds_tensor.dtype, pp.device_of(first)
        total = sum(self.sizes)
        by_exchange = gathers_by_exchange(self.group, device)
        if self.shards is not None and (self.header is not None or len(self.params) > 1):
            # Sent from the unit's storage, nothing packed. An exchange lands the other ranks'
            # rows only; this rank's is read from the storage again at the copy-out.
            send = self.shards.row(self.header)
            self.gathered = self._buffer(send.numel() * self.world, send.dtype, device)
            if by_exchange and self.header is not None:  # read_headers reads every row's
                row = send.numel()
                start = rank * row + self.shards.data_bytes
                self.gathered[start : start + header_bytes()].copy_(self.header.view(torch.uint8))
            self.own_from_shards = by_exchange
            self.works = launch_all_gather(
                self.gathered, send, self.group, by_exchange=by_exchange, own_in_full=False
            )
        else:
            # This rank's part is packed straight into its slice of the receive buffer: the
            # collective sends it from there.
            if self.header is not None:  # bytes: the shards, then the header
                data_bytes = total * first.ds_tensor.element_size()
                row = data_bytes + header_bytes()
                self.gathered = self._buffer(row * self.world, torch.uint8, device)
                own = self.gathered.narrow(0, rank * row, row)
                self._pack_shards(own[:data_bytes].view(dtype))
                own[data_bytes:].copy_(self.header.view(torch.uint8))
            elif len(self.params) == 1:  # straight into the parameter's whole tensor
                self.gathered = pp.whole_buffer(first, total * self.world)
                own = self.gathered.narrow(0, rank * total, total)
                _read_shard_into(first, own)
            else:
                self.gathered = self._buffer(total * self.world, dtype, device)
                own = self.gathered.narrow(0, rank * total, total)
                self._pack_shards(own)
            self.works = launch_all_gather(self.gathered, own, self.group, by_exchange=by_exchange)
        for param in self.params:
            param.ds_works = self
            param.ds_status = pp.ZeroParamStatus.INFLIGHT

    def _pack_shards(self, send: torch.Tensor) -> None:
        """This rank's shards of every parameter, one after another, into ``send``."""
        if any(getattr(p, "ds_home", None) is not None for p in self.params):
            for param, piece in zip(self.params, send.split(self.sizes)):
                _read_shard_into(param, piece)
        else:  # one op, not one copy per parameter (a deep model's units hold hundreds)
            torch.cat([p.ds_tensor for p in self.params], out=send)

    def finish(self) -> None:
        if self.works is None:
            return
        with named_collective(
            lambda: (
                f"all_gather (fetch) of ZeRO-3 parameters {pp.describe(self.params[0])}"
                + (f" and {len(self.params) - 1} more" if len(self.params) > 1 else "")
            )
        ):
            for work in self.works:
                work.wait()
        self.works = None
        headers = None
        if self.header is not None:
            first = self.params[0]
            data_bytes = sum(self.sizes) * first.ds_tensor.element_size()
            headers = read_headers(self.gathered, data_bytes, self.world)
            data = self.gathered.view(self.world, -1)[:, :data_bytes].view(first.ds_tensor.dtype)
        else:
            data = self.gathered.view(self.world, -1)
        if len(self.params) == 1 and self.header is None:
            wholes = [self.gathered]
        else:
            # Each parameter's pieces out of the rank-by-rank buffer into its whole tensor, all
            # in one op (as FSDP2's copy-out), not one copy per parameter.
            first = self.params[0]
            dtype, device, world = first.ds_tensor.dtype, pp.device_of(first), self.world
            wholes = [
                pp.whole_buffer(param, size * world, dtype, device)
                for param, size in zip(self.params, self.sizes)
            ]
            self._copy_out(data, [whole.view(self.world, -1) for whole in wholes])
        if self.buffers is not None and wholes[0] is not self.gathered:  # not a parameter's own
            self.buffers.give_back(self.gathered)
        self.gathered = None  # frees the rank-by-rank buffer (or leaves it to ``buffers``)
        available = pp.ZeroParamStatus.AVAILABLE
        for param, whole in zip(self.params, wholes):
            param.ds_works = None
            param.data = whole[: param.ds_numel].view(param.ds_shape)
            param.ds_status = available
        if headers is not None:  # the parameters are whole either way; raises if ranks differ
            self.agreement.landed(self, headers)

    def _copy_out(self, data: torch.Tensor, wholes: list[torch.Tensor]) -> None:
        """Each parameter's pieces (``data``: one row per rank) into its whole tensor
        (``wholes``: each viewed as one row per rank), in one op per run of rows, as FSDP2's
        copy-out, not one copy per parameter; this rank's row from the unit's storage when the
        collective did not land it."""
        if not self.own_from_shards:
            torch.split_with_sizes_copy(data, self.sizes, dim=1, out=wholes)
            return
        rank = dist.get_rank(self.group)
        own = self.shards.data().view(1, -1)
        for rows, source in (
            ((0, rank), data),
            ((rank, rank + 1), own),
            ((rank + 1, self.world), data),
        ):
            low, high = rows
            if low < high:
                piece = source if source is own else source[low:high]
                out = [whole[low:high] for whole in wholes]
                torch.split_with_sizes_copy(piece, self.sizes, dim=1, out=out)


def _read_shard_into(param: torch.nn.Parameter, destination: torch.Tensor) -> None:
    home = getattr(param, "ds_home", None)
    if home is not None:  # offloaded: read from the host or NVMe into place
        home.read_into(param, destination)
    else:
        destination.copy_(param.ds_tensor)
