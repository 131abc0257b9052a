"""ZeRO-3 parameters: each split into equal, padded shards, one per rank, whole only while used.

A partitioned parameter keeps DeepSpeed's attributes:

- ``ds_id`` (unique per process), ``ds_shape``, ``ds_numel``: the whole parameter's;
- ``ds_tensor``: this rank's shard, 1-D, ``ceil(ds_numel / world)`` elements rounded up so that
  every shard is a multiple of 16 elements (the padding is zeros at the end of the last shards);
- ``ds_status``: ``ZeroParamStatus.NOT_AVAILABLE`` (only the shard is here), ``INFLIGHT`` (a
  gather is under way) or ``AVAILABLE`` (whole);
- ``ds_persist``: small parameters (``stage3_param_persistence_threshold``) stay whole on every
  rank; their ``ds_tensor`` is the whole tensor.

While not available, ``param.data`` is an empty tensor of the parameter's dtype, so ``param.shape``
is ``(0,)`` and ``param.numel()`` is 0, as in DeepSpeed; use ``ds_shape``/``ds_numel``. Gathering
all-gathers the shards into one flat tensor of the padded size that the parameter then views (no
copy); several holders (a module, ``GatheredParameters``, a tied use) may hold a parameter at
once: it is released when the last lets go (``ds_active``).
"""

from __future__ import annotations

import enum
import itertools

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from .param_summary import attach_summary
from .shard_gather import gathers_by_exchange, launch_all_gather

SHARD_ALIGNMENT = 16  # elements; the bucket planner pads with the same multiple


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


_ids = itertools.count()


def is_zero_param(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter that is not kept whole (persistent)."""
    return hasattr(param, "ds_id") and not param.ds_persist


def describe(param: torch.Tensor) -> str:
    """``'name' (ds_id=N, shape [...])``: names are known once an engine has seen the model."""
    name = getattr(param, "ds_name", None)
    where = f"'{name}' " if name else ""
    return f"{where}(ds_id={param.ds_id}, shape {list(param.ds_shape)})"


def padded_numel(numel: int, world_size: int) -> int:
    multiple = world_size * SHARD_ALIGNMENT
    return max(1, -(-numel // multiple)) * multiple


def group_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def partition_parameter(
    param: torch.nn.Parameter,
    group=None,
    *,
    persist: bool = False,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
    synced: torch.Tensor | None = None,
) -> None:
    """Makes a whole ``param`` a ZeRO-3 parameter: every rank takes rank 0's values (broadcast,
    so that all ranks agree whatever their random initialisation) and, unless ``persist``, keeps
    only its shard. Transiently holds the whole parameter once. ``synced``: the parameter's data
    already cast, moved and broadcast by the caller (zero.Init broadcasts a module's parameters
    together); ``dtype`` and ``device`` are then unused."""
    world, rank = group_world(group)
    with torch.no_grad():
        data = param.data if synced is None else synced
        if synced is None and (device is not None or dtype is not None):
            data = data.to(device=device or data.device, dtype=dtype or data.dtype)
        if world > 1 and synced is None:
            data = data.contiguous()
            with named_collective(
                lambda: (
                    f"broadcast from rank 0 of a parameter of shape {list(data.shape)} "
                    f"being partitioned for ZeRO-3 (zero.Init)"
                )
            ):
                dist.broadcast(data, group_src=0, group=group)
        param.ds_id = next(_ids)
        param.ds_shape = tuple(data.shape)
        param.ds_numel = data.numel()
        param.ds_persist = bool(persist)
        param.ds_active = 0
        param.ds_group = group
        param.ds_works = None
        param.ds_whole = None
        attach_summary(param)
        if persist:
            param.data = data
            param.ds_tensor = data
            param.ds_status = ZeroParamStatus.AVAILABLE
            return
        # Only this rank's part is copied out (zero padding past the end): a padded copy of the
        # whole would double the memory that building a model under zero.Init holds per module.
        shard = padded_numel(data.numel(), world) // world
        flat = data.reshape(-1)
        start = min(rank * shard, flat.numel())
        end = min(start + shard, flat.numel())
        param.ds_tensor = torch.zeros(shard, dtype=data.dtype, device=data.device)
        param.ds_tensor[: end - start].copy_(flat[start:end])
        del flat
        param.data = torch.empty(0, dtype=data.dtype, device=data.device)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def unpartition_parameter(param: torch.nn.Parameter) -> None:
    """Makes a partitioned parameter whole and persistent (collective)."""
    if not is_partitioned(param):
        return
    launch_gather(param)
    wait_gather(param)
    param.ds_persist = True
    param.ds_tensor = param.data


def launch_gather(param: torch.nn.Parameter, group=None) -> None:
    """Starts gathering ``param`` (and counts one more holder) over ``group`` (default: the
    group it was partitioned over, or another of the same ranks); a parameter already whole or
    in flight is only counted. Every rank must launch the same gathers in the same order."""
    if claim(param):
        start_gather(param, group)


def claim(param: torch.nn.Parameter) -> bool:
    """Counts one more holder of ``param``; True when it must be gathered (only its shard is
    here), False when it is persistent, whole or already in flight."""
    if param.ds_status is ZeroParamStatus.NOT_AVAILABLE and param.numel() != 0:
        raise RuntimeError(
            f"ZeRO-3 parameter {describe(param)} was given new "
            f"data of shape {list(param.data.shape)} while partitioned; change a partitioned "
            f"parameter inside deepspeed_cpp.zero.GatheredParameters(..., modifier_rank=...)"
        )
    param.ds_active += 1
    return not param.ds_persist and param.ds_status == ZeroParamStatus.NOT_AVAILABLE


def start_gather(param: torch.nn.Parameter, group=None) -> None:
    """Launches the gather of a claimed ``param`` on its own (``unit.py`` gathers several in
    one collective)."""
    group = group if group is not None else param.ds_group
    world, rank = group_world(group)
    shard = param.ds_tensor
    full = whole_buffer(param, shard.numel() * world)
    home = getattr(param, "ds_home", None)
    if home is not None:  # offloaded: the shard comes from the host or NVMe into its place
        own = full.narrow(0, rank * shard.numel(), shard.numel())
        home.read_into(param, own)
        shard = own
    if world == 1:
        full.copy_(shard)
        works = []
    else:
        by_exchange = gathers_by_exchange(group, shard.device)
        works = launch_all_gather(full, shard, group or dist.group.WORLD, by_exchange=by_exchange)
    param.ds_works = (full, works)
    param.ds_status = ZeroParamStatus.INFLIGHT


def wait_gather(param: torch.nn.Parameter) -> None:
    """Waits for ``param``'s gather, after which it is whole (views the gathered flat tensor)."""
    if param.ds_status != ZeroParamStatus.INFLIGHT:
        return
    if hasattr(param.ds_works, "finish"):  # one gather of several parameters (unit.py)
        param.ds_works.finish()
        return
    full, works = param.ds_works
    with named_collective(lambda: f"all_gather (fetch) of ZeRO-3 parameter {describe(param)}"):
        for work in works:
            work.wait()
    param.ds_works = None
    param.data = full.narrow(0, 0, param.ds_numel).view(param.ds_shape)
    param.ds_status = ZeroParamStatus.AVAILABLE


def release(param: torch.nn.Parameter) -> None:
    """One holder lets go; the last one frees the whole tensor (waiting for a gather still in
    flight first: its buffer may not be freed under a running collective)."""
    active = param.ds_active
    if active <= 0:
        raise RuntimeError(f"ZeRO-3 parameter {describe(param)} released more often than gathered")
    param.ds_active = active - 1
    if active > 1 or param.ds_persist:
        return
    if param.ds_status is ZeroParamStatus.INFLIGHT:
        wait_gather(param)
    if param.shape != param.ds_shape:  # torch.Size equals the tuple of the same sizes
        raise RuntimeError(
            f"ZeRO-3 parameter {describe(param)} changed shape while gathered: it was "
            f"{list(param.ds_shape)}, it is {list(param.shape)}; a partitioned parameter's "
            f"shape is fixed (re-create it under zero.Init to change it)"
        )
    whole = param.ds_whole  # made by the gather in the shard's dtype, on the parameter's device
    param.data = _empty(whole.dtype, whole.device)
    # Autograd keeps views of the whole parameter that the forward made (a linear layer saves
    # weight.t()), which would keep every gathered tensor alive until the backward; emptying
    # the storage frees the memory now, and the next gather refills the same storage, so those
    # views hold the right values again when the backward reads them (FSDP2 does the same).
    whole.untyped_storage().resize_(0)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


_EMPTIES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of ``dtype`` on ``device`` for a released parameter's data, one per
    (dtype, device) for the process: a release per parameter per step made one afresh each time.
    Never written: it holds no element, and ``claim`` refuses a parameter whose data grew."""
    empty = _EMPTIES.get((dtype, device))
    if empty is None:
        empty = _EMPTIES[(dtype, device)] = torch.empty(0, dtype=dtype, device=device)
    return empty


def whole_buffer(
    param: torch.nn.Parameter,
    numel: int,
    dtype: torch.dtype | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    """The parameter's flat, padded whole tensor: one storage for its lifetime, emptied between
    uses (see ``release``). ``dtype`` and ``device``: the shard's and ``device_of(param)``, when
    the caller knows them already (a gather of several parameters shares them)."""
    whole = getattr(param, "ds_whole", None)
    if dtype is None or device is None:
        dtype, device = param.ds_tensor.dtype, device_of(param)
    if whole is None or whole.dtype != dtype or whole.device != device:
        whole = torch.empty(numel, dtype=dtype, device=device)
        param.ds_whole = whole
    else:
        whole.untyped_storage().resize_(numel * whole.element_size())
    return whole


def write_back(param: torch.nn.Parameter) -> None:
    """Copies a whole ``param``'s current values (identical on every rank) into its shard."""
    if not param.ds_persist:
        write_shard(param, param.data)


def write_shard(param: torch.nn.Parameter, whole: torch.Tensor) -> None:
    """Sets ``param``'s shard to this rank's part of ``whole`` (the parameter's values, any
    device), zero padding included."""
    if tuple(whole.shape) != param.ds_shape:
        raise ValueError(
            f"cannot write a tensor of shape {list(whole.shape)} into ZeRO-3 parameter "
            f"{describe(param)}"
        )
    _, rank = group_world(param.ds_group)
    home = getattr(param, "ds_home", None)
    shard = param.ds_tensor if home is None else torch.empty_like(param.ds_tensor, device="cpu")
    flat = whole.reshape(-1)
    start = rank * shard.numel()
    end = min(start + shard.numel(), flat.numel())
    with torch.no_grad():
        shard.zero_()
        if end > start:
            shard[: end - start].copy_(flat[start:end])
        if home is not None:
            home.store(param, shard)


def read_shard(param: torch.nn.Parameter) -> torch.Tensor:
    """This rank's shard of ``param`` (a copy when it lives on NVMe)."""
    home = getattr(param, "ds_home", None)
    return param.ds_tensor if home is None else home.read(param)


def store_shard(param: torch.nn.Parameter, values: torch.Tensor) -> None:
    """Sets this rank's shard of ``param`` to ``values`` (cast to its dtype)."""
    home = getattr(param, "ds_home", None)
    with torch.no_grad():
        if home is None:
            param.ds_tensor.copy_(values)
        else:
            home.store(param, values)


def device_of(param: torch.nn.Parameter) -> torch.device:
    """The device ``param`` is used on (its shard may live on the host or NVMe)."""
    home = getattr(param, "ds_home", None)
    return param.ds_tensor.device if home is None else home.device


def gather_all(params) -> None:
    """Gathers ``params`` (launching every gather before waiting for any)."""
    params = list(params)
    for param in params:
        launch_gather(param)
    for param in params:
        wait_gather(param)
