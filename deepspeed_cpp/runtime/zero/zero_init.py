"""``zero.Init``: partitions every module's parameters as soon as it is constructed, so that a
model too big for one rank can be built (re-exported under DeepSpeed's path,
``partition_parameters``)."""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...comm.entry_agreement import agree_on_entries
from .construction_heap import note_freed
from .partitioned_params import group_world, is_zero_param, partition_parameter
from .tensor_constructors import ORIGINAL_CONSTRUCTORS


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
        if group_world(self.group)[0] > 1:
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
        _ACTIVE.append(self)
        self._patch()
        return self

    def _patch(self) -> None:
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
        # Looked up now, by name, in DeepSpeed's module path (partition_parameters, which
        # imports this module: hence here, not at the top): transformers swaps the wrapper there
        # around the block (prevent_arange_dtype_change) to keep torch.arange's explicit dtypes.
        from . import partition_parameters

        wrap = partition_parameters.zero_wrapper_for_fp_tensor_constructor
        for name, original in ORIGINAL_CONSTRUCTORS.items():
            self._patched.append((torch, name, getattr(torch, name)))
            setattr(torch, name, wrap(original, self.dtype, target_device=self.device))

    def __exit__(self, *exc_info):
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        self._unpatch()
        return False

    def _unpatch(self) -> None:
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


# The zero.Init blocks entered and not yet left, innermost last.
_ACTIVE: list[Init] = []


@contextlib.contextmanager
def paused():
    """Lifts every active zero.Init for the block: ``initialize()`` called inside one (as
    DeepSpeed allows) builds the engine's own buffers in the dtypes it asks for, and the engine
    (an ``nn.Module``) is not partitioned as a model module would be."""
    active = list(_ACTIVE)
    for context in reversed(active):
        context._unpatch()
    try:
        yield
    finally:
        for context in active:
            context._patch()


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
