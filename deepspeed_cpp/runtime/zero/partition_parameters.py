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
import functools
import itertools

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...comm.entry_agreement import agree_on_entries
from .construction_heap import note_freed
from .external_parameters import (  # noqa: F401  (DeepSpeed's module path for them)
    register_external_parameter,
    unregister_external_parameter,
)
from .gather_handles import (  # noqa: F401  (DeepSpeed's module path for them)
    MultipleAllGatherHandles,
    partitioned_param_data_shape,
)
from .param_summary import attach_summary
from .shard_gather import backend_for, launch_all_gather

# DeepSpeed's module-level names that transformers reads (and swaps) here while it builds a model
# under a live stage-3 config; ``Init.__enter__`` looks the wrapper up in this module's globals.
from .tensor_constructors import (  # noqa: F401  (re-exported under DeepSpeed's module path)
    ORIGINAL_CONSTRUCTORS,
    _orig_torch_arange,
    _orig_torch_empty,
    _orig_torch_eye,
    _orig_torch_full,
    _orig_torch_ones,
    _orig_torch_randn,
    _orig_torch_tensor,
    _orig_torch_zeros,
    get_accelerator,
    zero_wrapper_for_fp_tensor_constructor,
)

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


def _world(group) -> tuple[int, int]:
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
    world, rank = _world(group)
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
    if param.ds_status == ZeroParamStatus.NOT_AVAILABLE and param.data.numel() != 0:
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
    world, rank = _world(group)
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
        by_broadcast = backend_for(group or dist.group.WORLD, shard.device) == "gloo"
        works = launch_all_gather(full, shard, group or dist.group.WORLD, by_broadcast=by_broadcast)
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
    if param.ds_active <= 0:
        raise RuntimeError(f"ZeRO-3 parameter {describe(param)} released more often than gathered")
    param.ds_active -= 1
    if param.ds_active or param.ds_persist:
        return
    wait_gather(param)
    if param.data.numel() != param.ds_numel or tuple(param.data.shape) != param.ds_shape:
        raise RuntimeError(
            f"ZeRO-3 parameter {describe(param)} changed shape while gathered: it was "
            f"{list(param.ds_shape)}, it is {list(param.data.shape)}; a partitioned parameter's "
            f"shape is fixed (re-create it under zero.Init to change it)"
        )
    param.data = torch.empty(0, dtype=param.ds_tensor.dtype, device=device_of(param))
    # Autograd keeps views of the whole parameter that the forward made (a linear layer saves
    # weight.t()), which would keep every gathered tensor alive until the backward; emptying
    # the storage frees the memory now, and the next gather refills the same storage, so those
    # views hold the right values again when the backward reads them (FSDP2 does the same).
    param.ds_whole.untyped_storage().resize_(0)
    param.ds_status = ZeroParamStatus.NOT_AVAILABLE


def whole_buffer(param: torch.nn.Parameter, numel: int) -> torch.Tensor:
    """The parameter's flat, padded whole tensor: one storage for its lifetime, emptied between
    uses (see ``release``)."""
    whole = getattr(param, "ds_whole", None)
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
    _, rank = _world(param.ds_group)
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


class GatheredParameters:
    """Gathers ZeRO-3 parameters for the duration of a ``with`` block.

    With ``modifier_rank`` set, the values that rank holds at the end of the block are broadcast
    and written back into every rank's shard (to initialise weights, resize an embedding, load
    values); without it, changes are discarded. Parameters that are not ZeRO-3 ones are left
    alone, so the same code runs at any stage. Every rank must enter the block. Changing values
    after ``initialize`` does not change the fp32 master weights (as in DeepSpeed): do it before.
    """

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if is_zero_param(p)] if enabled else []
        self.modifier_rank = modifier_rank
        if enabled and modifier_rank is not None:
            world, _ = _world(self.params[0].ds_group if self.params else None)
            if not isinstance(modifier_rank, int) or not 0 <= modifier_rank < world:
                raise ValueError(
                    f"GatheredParameters: modifier_rank={modifier_rank!r} is out of range; "
                    f"expected a rank in [0, {world}) or None"
                )
        if fwd_module is not None:
            for param in self.params:
                register_external_parameter(fwd_module, param)

    def __enter__(self):
        gather_all(self.params)
        return self.params

    def __exit__(self, *exc_info):
        if self.modifier_rank is not None and exc_info[0] is None:
            with torch.no_grad():
                for param in self.params:
                    world, _ = _world(param.ds_group)
                    if world > 1:
                        data = param.data.contiguous()
                        with named_collective(
                            lambda param=param: (
                                f"broadcast from rank {self.modifier_rank} of "
                                f"ZeRO-3 parameter {describe(param)} leaving GatheredParameters"
                            )
                        ):
                            dist.broadcast(data, group_src=self.modifier_rank, group=param.ds_group)
                        param.data.copy_(data)
                    write_back(param)
        for param in self.params:
            release(param)
        note_freed(self.params)  # loading module by module frees a whole module each time
        return False


def _all_module_classes(root=torch.nn.Module):
    seen, stack = [], [root]
    while stack:
        cls = stack.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                stack.append(sub)
    return [root, *seen]


class Init:
    """Partitions every module's parameters as soon as the module is constructed, so that a
    model too big for one rank can be built: under it, building an S-byte model on N ranks holds
    about S/N plus the largest module's parameters per rank.

    DeepSpeed's signature. ``config_dict_or_path`` (or ``config``) supplies
    ``stage3_param_persistence_threshold`` (parameters that small stay whole) and, when ``dtype``
    is None, the fp16/bf16 dtype (fp32 where neither is enabled); given neither a config nor a
    ``dtype``, the parameters become fp16 where the accelerator supports it, else bf16, as
    DeepSpeed's are. Refused: ``remote_device`` other than None/"none" (parameter
    offload is not built yet) and ``mpu`` (no model parallelism). ``mem_efficient_linear`` is
    accepted and has no effect (a partitioned weight is gathered again for the backward anyway).

    Inside the block, as in DeepSpeed, torch's tensor constructors (``torch.empty``, ``zeros``,
    ``arange``, ...; tensor_constructors.py) make tensors given no ``device=`` on the rank's
    accelerator and cast floating-point ones to the ZeRO-3 dtype, so buffers built in
    ``__init__`` match the parameters. This is what transformers' ``from_pretrained`` and
    ``from_config`` enter while a stage-3 ``HfDeepSpeedConfig`` is alive (under the
    ``import deepspeed`` alias).

    A module's own parameters are partitioned when its ``__init__`` returns: initialise weights
    inside ``__init__`` (or under ``GatheredParameters(..., modifier_rank=0)`` afterwards).
    Models built inside go straight into ``initialize``, which takes the partitioned parameters
    as they are.
    """

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group=None,
        mem_efficient_linear: bool = True,
        remote_device=None,
        pin_memory: bool = False,
        config_dict_or_path=None,
        config=None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu=None,
    ):
        if remote_device not in (None, "none"):
            raise NotImplementedError(
                f"zero.Init(remote_device={remote_device!r}): parameter offload is not supported "
                f"yet by deepspeed_cpp; expected None"
            )
        if mpu is not None:
            raise NotImplementedError("zero.Init(mpu=...): model parallelism is not supported")
        self.enabled = enabled
        self.group = data_parallel_group
        self.device = None
        if enabled:
            from ...accelerator import get_accelerator
            from ...comm import init_distributed
            from ...comm.exit_grace import release_gil_at_exit

            # As DeepSpeed: shards must be split over the real world size, and live on the
            # accelerator (an NCCL group takes no CPU tensors).
            init_distributed()
            release_gil_at_exit()  # gathers of partitioned parameters must not abort the exit
            self.device = torch.device(get_accelerator().current_device_name())
        given = config_dict_or_path if config_dict_or_path is not None else config
        self.persistence_threshold, config_dtype = _init_settings(given)
        self.dtype = dtype or config_dtype
        if given is None and dtype is None:
            # DeepSpeed's choice for zero.Init() given neither a config nor a dtype: half
            # precision, fp16 where the accelerator supports it, else bf16.
            from ...accelerator import get_accelerator

            fp16 = get_accelerator().is_fp16_supported()
            self.dtype = torch.float16 if fp16 else torch.bfloat16
        self._patched: list[tuple[type, str, object]] = []
        if module is not None and enabled:
            for submodule in module.modules():
                self._partition_own(submodule)

    def _partition_own(self, module: torch.nn.Module) -> None:
        own = [
            (name, param)
            for name, param in module.named_parameters(recurse=False)
            if not is_zero_param(param)
        ]
        if not own:
            return
        synced = [None] * len(own)
        if _world(self.group)[0] > 1:
            self._agree_on_module(module, own)
            synced = self._broadcast_together(module, own)
        for (_, param), data in zip(own, synced):
            partition_parameter(
                param,
                self.group,
                persist=param.numel() <= self.persistence_threshold,
                dtype=self.dtype if param.is_floating_point() else None,
                device=self.device,
                synced=data,
            )
        # The broadcast copies die here, before the heap is trimmed for the whole tensors.
        del synced, data
        note_freed([param for _, param in own])

    def _broadcast_together(self, module: torch.nn.Module, own: list) -> list[torch.Tensor]:
        """Rank 0's values of the module's own parameters (cast and moved as partitioning
        wants them): every broadcast is launched before the first is waited for, so the module
        costs about one round trip instead of one per parameter, which pays for the agreement's.
        Holds the module's own parameters in their target dtype at once (a copy only where
        they are cast or moved)."""
        with torch.no_grad():
            datas = [
                param.data.to(
                    device=self.device,
                    dtype=self.dtype if param.is_floating_point() else None,
                ).contiguous()
                for _, param in own
            ]
        owner = type(module).__qualname__
        with named_collective(
            lambda: (
                f"broadcast from rank 0 of the {len(datas)} parameters of a {owner} being "
                f"partitioned for ZeRO-3 (zero.Init)"
            )
        ):
            works = [
                dist.broadcast(data, group_src=0, group=self.group, async_op=True) for data in datas
            ]
            for work in works:
                work.wait()
        return datas

    def _agree_on_module(self, module: torch.nn.Module, own: list) -> None:
        """The module's parameters are broadcast from rank 0 as it is built: a rank whose module
        differs (a layer 33 wide instead of 32, another dtype, modules built in another order)
        would make gloo abort the process. The ranks agree on the module's parameters first
        (one 32-byte all-gather per module; initialize() checks the rest of the set-up)."""
        entries = [("module", type(module).__qualname__), ("parameters", str(len(own)))]
        for index, (name, param) in enumerate(own):
            dtype = self.dtype if self.dtype is not None and param.is_floating_point() else None
            dtype = str(dtype or param.dtype).removeprefix("torch.")
            persist = "persistent" if param.numel() <= self.persistence_threshold else "sharded"
            entries.append(
                (f"parameter #{index}", f"'{name}' shape {list(param.shape)}, {dtype}, {persist}")
            )
        agree_on_entries(
            entries,
            what=f"in zero.Init, partitioning the parameters of a {type(module).__qualname__}",
            advice="every rank must build the same modules, in the same order, under zero.Init",
            device=self.device,
            group=self.group,
        )

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None:
            return
        context = self

        # Wrapped as DeepSpeed's partition_after is (functools.wraps): what inspects the class
        # sees its own __init__. transformers' @auto_docstring reads the signature of the
        # __init__ of each model class defined in the block (a model module first imported
        # there, as from_config or from_pretrained does) and printed "[ERROR] `module` is part
        # of Init._wrap.<locals>.init_then_partition's signature" for each.
        @functools.wraps(original)
        def init_then_partition(module, *args, **kwargs):
            depth = module.__dict__.get("_ds_init_depth", 0)
            object.__setattr__(module, "_ds_init_depth", depth + 1)
            try:
                original(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_ds_init_depth", depth)
            if depth == 0:
                del module.__dict__["_ds_init_depth"]
                context._partition_own(module)

        cls.__init__ = init_then_partition
        self._patched.append((cls, "__init__", original))

    def __enter__(self):
        if not self.enabled:
            return self
        for cls in _all_module_classes():
            self._wrap(cls)
        context = self
        original_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def wrap_new_class(cls, **kwargs):
            # Classes defined inside the block are wrapped too.
            if original_init_subclass is not None:
                original_init_subclass.__func__(cls, **kwargs)
            else:
                super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            context._wrap(cls)

        torch.nn.Module.__init_subclass__ = classmethod(wrap_new_class)
        self._patched.append((torch.nn.Module, "__init_subclass__", original_init_subclass))
        # Looked up now, by name, in this module: transformers swaps the wrapper around the block
        # (prevent_arange_dtype_change) to keep torch.arange's explicit dtypes.
        wrap = globals()["zero_wrapper_for_fp_tensor_constructor"]
        for name, original in ORIGINAL_CONSTRUCTORS.items():
            self._patched.append((torch, name, getattr(torch, name)))
            setattr(torch, name, wrap(original, self.dtype, target_device=self.device))
        return self

    def __exit__(self, *exc_info):
        for cls, name, original in reversed(self._patched):
            if original is None:
                delattr(cls, name)
                continue
            wrapper = cls.__dict__.get(name) if isinstance(cls, type) else None
            if name == "__init__" and wrapper is not None and wrapper.__doc__ != original.__doc__:
                # A docstring written onto the wrapper while it stood in (transformers'
                # @auto_docstring on a class defined in the block) stays with the class.
                original.__doc__ = wrapper.__doc__
            setattr(cls, name, original)
        self._patched.clear()
        return False


def _init_settings(config) -> tuple[int, torch.dtype | None]:
    """(persistence threshold, dtype) from a ds_config dict or path (DeepSpeed's defaults)."""
    if config is None:
        return 100_000, None
    if not isinstance(config, dict):
        import json
        from pathlib import Path

        config = json.loads(Path(config).read_text())
    zero = config.get("zero_optimization") or {}
    threshold = zero.get("stage3_param_persistence_threshold", 100_000)
    threshold = threshold if isinstance(threshold, int) else 100_000  # "auto": the default
    dtype = None
    if (config.get("fp16") or {}).get("enabled") is True:
        dtype = torch.float16
    elif (config.get("bf16") or config.get("bfloat16") or {}).get("enabled") is True:
        dtype = torch.bfloat16
    return threshold, dtype
