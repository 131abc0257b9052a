"""A ZeRO-3 fetch unit: the partitioned parameters one module (or a leaf module's subtree) needs,
gathered with one collective instead of one per parameter.

Every parameter keeps its own padded shard (``ds_tensor``: the layout the optimizer, offload homes
and checkpoints rely on). ``unshard`` concatenates the unit's shards into one flat send buffer and
all-gathers it once into one buffer laid out rank by rank; ``wait`` copies each parameter's
pieces out of it into the parameter's whole tensor (``ds_whole``, whose storage is kept for the
parameter's lifetime and emptied on release, so the views autograd saved stay valid) and frees
the gathered buffer. A unit of one parameter gathers straight into its whole tensor, no copy.

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
from .shard_gather import all_gather_flat


class ZeroUnit:
    """The partitioned parameters of one fetch unit (``name``: the module's, for messages)."""

    def __init__(self, params: list[torch.nn.Parameter], name: str):
        self.params = params
        self.name = name

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
    # Per (dtype, device): the collectives being packed, each a list of parameters and its size.
    packs: dict[tuple, list[tuple[list[torch.nn.Parameter], int]]] = {}
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
                last, total = open_packs[-1]
                open_packs[-1] = (last + params, total + size)
            else:
                open_packs.append((params, size))
    collectives = [params for open_packs in packs.values() for params, _size in open_packs]
    if world == 1:
        for params in collectives:
            for param in params:
                pp.start_gather(param, group)
        return
    headers = None
    if agreement is not None and collectives:
        layouts = [(_data_bytes(params), pp.device_of(params[0])) for params in collectives]
        headers = agreement.headers_for(layouts, use)
    for index, params in enumerate(collectives):
        if headers is None:
            _FlatGather(params, group, world, buffers=buffers).launch()
        else:
            gather = _FlatGather(params, group, world, headers[index], agreement, buffers)
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
    ):
        """``header``: int64 values sent after this rank's data and compared on every rank by
        ``agreement.landed`` once the gather landed (``pass_agreement.py``)."""
        self.params = params
        self.group = group
        self.world = world
        self.sizes = [p.ds_tensor.numel() for p in params]
        self.header = header
        self.agreement = agreement
        self.work = None
        self.gathered = None
        self.send = None  # kept until the gather landed, then handed back to ``buffers``
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
        if self.header is not None:  # bytes: the shards, then the header
            data_bytes = total * first.ds_tensor.element_size()
            send = self._buffer(data_bytes + header_bytes(), torch.uint8, device)
            self._pack_shards(send[:data_bytes].view(dtype))
            send[data_bytes:].copy_(self.header.view(torch.uint8))
            self.gathered = self._buffer(send.numel() * self.world, torch.uint8, device)
            self.send = send
        elif len(self.params) == 1:  # straight into the parameter's whole tensor
            size = self.sizes[0]
            self.gathered = pp.whole_buffer(first, size * self.world)
            send = self.gathered.narrow(0, rank * size, size)
            _read_shard_into(first, send)
        else:
            send = self._buffer(total, dtype, device)
            self._pack_shards(send)
            self.gathered = self._buffer(total * self.world, dtype, device)
            self.send = send
        self.work = all_gather_flat(self.gathered, send, self.group)
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
        if self.work is None:
            return
        with named_collective(
            lambda: (
                f"all_gather (fetch) of ZeRO-3 parameters {pp.describe(self.params[0])}"
                + (f" and {len(self.params) - 1} more" if len(self.params) > 1 else "")
            )
        ):
            self.work.wait()
        self.work = None
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
            wholes = [
                pp.whole_buffer(param, size * self.world)
                for param, size in zip(self.params, self.sizes)
            ]
            torch.split_with_sizes_copy(
                data, self.sizes, dim=1, out=[whole.view(self.world, -1) for whole in wholes]
            )
        if self.buffers is not None and self.send is not None:  # not a parameter's own tensor
            self.buffers.give_back(self.send)
            self.buffers.give_back(self.gathered)
        self.send = None
        self.gathered = None  # frees the rank-by-rank buffer (or leaves it to ``buffers``)
        for param, whole in zip(self.params, wholes):
            param.ds_works = None
            param.data = whole.narrow(0, 0, param.ds_numel).view(param.ds_shape)
            param.ds_status = pp.ZeroParamStatus.AVAILABLE
        if headers is not None:  # the parameters are whole either way; raises if ranks differ
            self.agreement.landed(self, headers)


def _read_shard_into(param: torch.nn.Parameter, destination: torch.Tensor) -> None:
    home = getattr(param, "ds_home", None)
    if home is not None:  # offloaded: read from the host or NVMe into place
        home.read_into(param, destination)
    else:
        destination.copy_(param.ds_tensor)
