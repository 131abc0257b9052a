"""ZeRO stage 3: parameters, gradients and optimizer state partitioned across the ranks.

``ZeroStage3`` puts the pieces together behind the ``ZeroStage`` interface:

- the model's parameters are partitioned (``partition_parameters``; those built under
  ``zero.Init`` already are), except small ones (``stage3_param_persistence_threshold``, within
  ``stage3_model_persistence_threshold`` in all), which stay whole on every rank;
- ``ParameterCoordinator`` gathers them per module while the model runs;
- a ``ZeroPartitionedOptimizer`` over ZeRO-3's bucket layout (``partitioned_buckets.py``) is the
  stage-2 machinery over the shards: every partitioned parameter is a bucket of its own whose
  rank-r shard is the parameter's ``ds_tensor``, gradients reduced one fetch unit at a time;
- with ``offload_param``, a parameter home (``offload/param_homes.py``) keeps the shards on the
  host or NVMe between uses; with ``offload_optimizer``, the masters and optimizer state live in
  the optimizer's home (``offload/optimizer_homes.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...utils.timer import OPTIMIZER_STEP_TIMER, timed
from . import partition_parameters as pp
from .coordinator import ParameterCoordinator
from .estimators import (
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
)
from .optimizer_kinds import DeepSpeedZeroOptimizer_Stage3
from .partitioned_optimizer import ZeroPartitionedOptimizer
from .stage import PartitionLayout

# DeepSpeed's module path for the ZeRO-3 memory estimators and its stage-3 optimizer's class name.
__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "ZeroStage3",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "partition_module",
]


class ZeroStage3:
    """The ``ZeroStage`` of stage 3 (see the module docstring). ``partitioned`` None: inference
    or evaluation only (parameters partitioned and gathered, nothing trained)."""

    stage = 3

    def __init__(
        self,
        group,
        coordinator: ParameterCoordinator,
        partitioned: ZeroPartitionedOptimizer | None,
        param_home=None,
    ):
        """Built by ``build.py`` (``_build_stage3``): the module's parameters already partitioned
        and hooked by ``coordinator``; ``partitioned`` (None without an optimizer) the stage
        stepping its shards; ``param_home`` the home of offloaded parameters."""
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.param_home = param_home
        self._stepping_next = True  # whether the backward under way ends with a step
        self.coordinator = coordinator
        self.partitioned = partitioned

    # --- what the engine reads like an optimizer --------------------------------------------------
    def __getattr__(self, name):
        # optimizer, reducer, param_groups, skipped_steps, global_grad_norm, checkpoint calls
        partitioned = self.__dict__.get("partitioned")
        if partitioned is None:
            raise AttributeError(f"ZeRO-3 without an optimizer has no '{name}'")
        return getattr(partitioned, name)

    def __setattr__(self, name, value):
        if name == "skipped_steps" and self.__dict__.get("partitioned") is not None:
            self.partitioned.skipped_steps = value
        else:
            object.__setattr__(self, name, value)

    @property
    def parameter_offload(self) -> ParameterCoordinator:
        """DeepSpeed's name for the part holding the ZeRO-3 hooks (``forward_hooks``,
        ``_register_deepspeed_module``): the coordinator."""
        return self.coordinator

    @property
    def trains(self) -> bool:
        return self.partitioned is not None

    # --- training ---------------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        self._stepping_next = boundary
        self.partitioned.begin_backward(boundary)

    def end_backward(self) -> None:
        self.coordinator.end_pass()
        if self.param_home is not None:
            self.param_home.end_pass()
            if not self._stepping_next:  # else after the step, which rewrites every shard
                self.param_home.read_ahead_first()
        self.partitioned.end_backward()

    def empty_partition_cache(self) -> None:
        """Releases the whole parameters a pass still holds (see ``release_held``)."""
        self.coordinator.release_held()

    def set_timers(self, timers) -> None:
        """Times the gathers, the gradient reduce-scatters and the optimizer step under
        ``timers`` (the engine's, with ``wall_clock_breakdown``; see ``utils/timer.py``)."""
        self.coordinator.timers = timers
        if self.partitioned is not None:
            self.partitioned.timers = timers
        self._step_timers = timers

    _step_timers = None

    def step(self) -> bool:
        with timed(self._step_timers, OPTIMIZER_STEP_TIMER):
            stepped = self.partitioned.step()
        if self.param_home is not None:
            self.param_home.read_ahead_first()  # overlaps the next forward's first gathers
        return stepped

    def zero_grad(self) -> None:
        if self.partitioned is not None:
            self.partitioned.zero_grad()

    def describe(self) -> str:
        units = len(self.coordinator.units)
        reduce = self.partitioned.describe() if self.partitioned is not None else "no optimizer"
        return f"{units} fetch units, {reduce}"

    # --- checkpoints ------------------------------------------------------------------------------
    def layout(self) -> PartitionLayout:
        return self.partitioned.layout()

    def load_shard_state(self, masters, states) -> None:
        self.partitioned.load_shard_state(masters, states)
        self.partitioned.write_params_from_masters()

    def refresh_masters_from_params(self) -> None:
        self.partitioned.refresh_masters_from_params()

    def full_state_dict(self, module: torch.nn.Module, *, rank0_only: bool) -> dict:
        """The module's state dict with every partitioned parameter gathered one at a time (on
        rank 0 only with ``rank0_only``: the other ranks never hold more than one).

        A tied parameter (one tensor under several names: GPT-2's ``lm_head.weight`` and
        ``transformer.wte.weight``) is gathered once and every name gets that one copy, as
        DeepSpeed's consolidated state dict shares it by ``ds_id``: transformers'
        ``save_pretrained`` tells tied names by shared storage and stores the tensor once, so
        a copy per name put the tied ``lm_head.weight`` into ``model.safetensors``."""
        if self.partitioned is not None:
            self.partitioned.apply_pending_update()
        result = {}
        first_name: dict[int, str] = {}
        keep = not rank0_only or self.rank == 0
        for name, value in module.state_dict(keep_vars=True).items():
            if pp.is_partitioned(value):
                shared = first_name.setdefault(id(value), name)
                if shared != name:
                    if keep:
                        result[name] = result[shared]
                    continue
                with pp.GatheredParameters([value]):
                    if keep:  # on the host: the whole model need not fit the device
                        result[name] = value.detach().to("cpu", copy=True)
            elif keep:
                result[name] = value.detach()
        return result

    def load_module_state(self, module: torch.nn.Module, state_dict: dict) -> None:
        """Loads whole tensors: partitioned parameters keep their shard of each."""
        if self.partitioned is not None:
            self.partitioned.discard_pending_update()
        rest = {}
        current = module.state_dict(keep_vars=True)
        for name, value in state_dict.items():
            target = current.get(name)
            if target is not None and pp.is_partitioned(target):
                pp.write_shard(target, value)
            else:
                rest[name] = value
        module.load_state_dict(rest, strict=False)

    def destroy(self) -> None:
        self.coordinator.destroy()
        try:
            if self.partitioned is not None:
                self.partitioned.destroy()
        finally:
            if self.param_home is not None:
                self.param_home.close()
                self.param_home = None


def partition_module(
    module: torch.nn.Module,
    group,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    param_threshold: int,
    model_threshold: int,
) -> None:
    """Partitions every parameter of ``module`` not yet partitioned (rank 0's values), makes
    the small ones persistent, casts the shards to ``dtype`` and moves shards and buffers to
    ``device``. Buffers keep their dtype, as at stages 0-2 and in DeepSpeed 0.19.8 (its engine
    casts parameters only: a rotary embedding's fp32 ``inv_freq`` stays fp32)."""
    persistent_total = 0
    seen = set()
    for name, param in module.named_parameters(remove_duplicate=False):
        if getattr(param, "ds_name", None) is None:
            param.ds_name = name  # for error messages
    for param in module.parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        numel = param.ds_numel if pp.is_zero_param(param) else param.numel()
        persist = numel <= param_threshold and persistent_total + numel <= model_threshold
        if persist:
            persistent_total += numel
        floating = (param.ds_tensor if pp.is_zero_param(param) else param).is_floating_point()
        cast = dtype if floating else None
        if not pp.is_zero_param(param):
            pp.partition_parameter(param, group, persist=persist, dtype=cast, device=device)
            continue
        # Moved and cast first: the collectives below need the shards on the group's device.
        if (cast is not None and param.ds_tensor.dtype != cast) or param.ds_tensor.device != device:
            _move_zero_param(param, device, cast or param.ds_tensor.dtype)
        if persist and pp.is_partitioned(param):
            pp.unpartition_parameter(param)
        elif not persist and param.ds_persist:
            data = param.data
            del param.ds_id
            param.data = data
            pp.partition_parameter(param, group, persist=False)
    for buffer_owner in module.modules():
        for name, buffer in buffer_owner.named_buffers(recurse=False):
            moved = buffer.to(device)
            if dist.get_world_size(group) > 1:
                with named_collective(
                    lambda name=name, owner=buffer_owner: (
                        f"broadcast from rank 0 of buffer '{name}' of "
                        f"{type(owner).__name__} (ZeRO-3 set-up)"
                    )
                ):
                    dist.broadcast(moved, group_src=0, group=group)
            buffer_owner._buffers[name] = moved


def _move_zero_param(param, device: torch.device, dtype: torch.dtype) -> None:
    param.ds_tensor = param.ds_tensor.to(device=device, dtype=dtype)
    param.ds_whole = None
    if param.ds_persist:
        param.data = param.ds_tensor
    else:
        param.data = torch.empty(0, dtype=dtype, device=device)
