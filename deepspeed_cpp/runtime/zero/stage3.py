"""ZeRO stage 3: parameters, gradients and optimizer state partitioned across the ranks.

``ZeroStage3`` puts the pieces together behind the ``ZeroStage`` interface:

- the model's parameters are partitioned (``partition_parameters``; those built under
  ``zero.Init`` already are), except small ones (``stage3_param_persistence_threshold``, within
  ``stage3_model_persistence_threshold`` in all), which stay whole on every rank;
- ``ParameterCoordinator`` gathers them per module while the model runs;
- ``Stage3Optimizer`` is the stage-2 machinery over the shards: every partitioned parameter is a
  bucket of its own whose rank-r shard is the parameter's ``ds_tensor`` (fp32 parameters are
  their own master weights; fp16/bf16 ones get fp32 masters written back into ``ds_tensor`` after
  each step), and the optimizer steps shards only. Gradients are reduced one fetch unit at a
  time: the unit's buckets form one reduction laid out rank by rank, whose one reduce-scatter
  (C++ reducer) fills the unit's flat shard gradient, each bucket's shard gradient a view into it;
  the persistent parameters share stage-2 buckets (all after the partitioned ones, so they never
  hold back a partitioned bucket's reduction);
- with ``offload_param``, a parameter home (``offload/param_homes.py``) keeps the shards on the
  host or NVMe between uses; with ``offload_optimizer``, the masters and optimizer state live in
  the optimizer's home (``offload/optimizer_homes.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...comm.reducer_tap import logged_if_enabled
from ...ops.zero import BucketPlan, make_gradient_reducer, plan_buckets
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
from .shard_set import Bucket as _Bucket
from .stage import PartitionLayout

# DeepSpeed's module path for the ZeRO-3 memory estimators and its stage-3 optimizer's class name.
__all__ = [
    "DeepSpeedZeroOptimizer_Stage3",
    "Stage3Optimizer",
    "ZeroStage3",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "partition_module",
]


class Stage3Optimizer(ZeroPartitionedOptimizer):
    """Stage-2 reduction and stepping over ZeRO-3 shards (see the module docstring)."""

    STAGES = (3,)

    def __init__(
        self,
        optimizer,
        param_groups,
        *,
        model_order: dict[int, int],
        unit_of_param: dict[int, int] | None = None,
        **kwargs,
    ):
        """``model_order``: ``id(param)`` -> its position in the model's registration order;
        ``unit_of_param``: ``id(param)`` -> the fetch unit whose gradients it is reduced with
        (a parameter in none is reduced on its own)."""
        self.model_order = model_order
        self.unit_of_param = unit_of_param or {}
        # step_during_backward steps a sub-group once its unit's gradients are reduced: units
        # sharing one reduction would hold every step back to the end of backward (see
        # _reduction_runs). Decided before the optimizer exists, so "maybe" (None) counts.
        offload = kwargs.get("offload")
        self._step_calls: list[list[int]] | None = None  # see bucket_step_calls
        self._units_reduced_apart = (
            offload is not None and offload.step_during_backward is not False
        )
        super().__init__(optimizer, param_groups, **kwargs)

    def _plan(self, param_groups, reduce_bucket_size, owned_whole):
        partitioned: list[tuple[int, torch.nn.Parameter]] = []
        persistent: list[tuple[int, torch.nn.Parameter]] = []
        for group_index, param_group in enumerate(param_groups):
            for param in reversed([p for p in param_group["params"] if p.requires_grad]):
                kind = partitioned if pp.is_partitioned(param) else persistent
                kind.append((group_index, param))
        # The reducer launches buckets strictly in order: put each partitioned parameter where
        # its gradient usually arrives, reverse registration order in the model, not group order
        # (layer-wise learning-rate groups would otherwise hold back every later bucket).
        position = self.model_order
        partitioned.sort(key=lambda item: -position.get(id(item[1]), -1))
        if not partitioned and not persistent:
            raise ValueError("the optimizer has no trainable parameters (requires_grad=True)")
        members = partitioned + persistent
        # One plan: a partitioned parameter alone in its bucket (its shard is the bucket's), the
        # persistent ones packed up to reduce_bucket_size after them.
        plan = plan_buckets(
            [p.ds_numel if pp.is_zero_param(p) else p.numel() for _, p in members],
            [g for g, _ in members],
            capacity=max(1, reduce_bucket_size),
            world_size=self.world_size,
            alignment=pp.SHARD_ALIGNMENT,
            alone=[True] * len(partitioned) + [False] * len(persistent),
        )
        params = [p for _, p in members]
        self._reduce_capacity = max(1, int(reduce_bucket_size))
        return params, plan

    def take_over_grad_hooks(self, param_ids: set[int]) -> dict[int, object]:
        """Removes this optimizer's gradient hooks of the parameters in ``param_ids`` and returns
        what they called, ``id(param)`` -> ``hook(param)``, for the coordinator to call from its
        own hook on those parameters (``ParameterCoordinator.hand_gradients_to``): autograd then
        runs one Python hook per partitioned parameter instead of two (194 fewer per backward
        on a 48-block model)."""
        taken = {}
        for index, param in enumerate(self.params):
            if id(param) in param_ids:
                self._hooks[index].remove()
                taken[id(param)] = self._make_hook(index)
        return taken

    # --- one reduction per unit -------------------------------------------------------------------
    def _make_shard_grads(self, device) -> list[torch.Tensor]:
        """Per bucket, a view into its reduction run's flat shard gradient (see
        ``_reduction_runs``): one reduce-scatter fills a whole run."""
        self._runs = self._reduction_runs()
        self._run_grads: list[torch.Tensor] = []  # the reducer's destinations
        grads: list[torch.Tensor | None] = [None] * len(self.buckets)
        for run in self._runs:
            sizes = [self.buckets[b].owned_size for b in run]
            flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
            self._run_grads.append(flat)
            for bucket, view in zip(run, flat.split(sizes)):
                grads[bucket] = view
        return grads

    def _reduction_runs(self) -> list[list[int]]:
        """The buckets in runs reduced by one collective each: the partitioned buckets (one
        parameter each) of one fetch unit, in bucket order, whatever ``reduce_bucket_size`` (the
        unit is gathered whole anyway, so its whole gradient costs what its gather does: one
        reduce-scatter per unit, as FSDP2); then consecutive partitioned runs merged up to
        ``reduce_bucket_size`` elements (a deep model's small blocks: one collective for many,
        as DeepSpeed's reduce bucket); every persistent bucket alone. Where sub-groups may be
        stepped during backward, a unit's buckets are instead cut into runs of at most
        ``reduce_bucket_size`` and never merged across units (``_split_at_capacity``). The
        buckets themselves keep their order, so masters, optimizer state and checkpoint layout
        stay one per parameter.

        The reducer launches runs strictly in order, so they are ordered by their last bucket
        (buckets follow the usual arrival of gradients): a unit whose members' gradients come
        at different times (a root unit holding every block's norm) is reduced once its last
        one arrives, without holding back the runs completed before it."""
        by_unit: dict[object, list[int]] = {}
        for index, bucket in enumerate(self.buckets):
            key = (
                self.unit_of_param.get(id(bucket.params[0]), ("alone", index))
                if self._partitioned(bucket)
                else ("persistent", index)
            )
            by_unit.setdefault(key, []).append(index)
        if self._units_reduced_apart:
            pieces = [piece for run in by_unit.values() for piece in self._split_at_capacity(run)]
            return sorted(pieces, key=lambda run: run[-1])
        runs: list[list[int]] = []
        for run in sorted(by_unit.values(), key=lambda run: run[-1]):
            previous = runs[-1] if runs else None
            if (
                previous is not None
                and self._partitioned(self.buckets[run[0]])
                and self._partitioned(self.buckets[previous[0]])
                and self._run_size(previous) + self._run_size(run) <= self._reduce_capacity
            ):
                previous.extend(run)
                previous.sort()  # a run's first bucket is its lowest (``_make_reducer``)
            else:
                runs.append(list(run))
        return runs

    def _run_size(self, run: list[int]) -> int:
        return sum(self.buckets[index].size for index in run)

    def _split_at_capacity(self, run: list[int]) -> list[list[int]]:
        """A unit's buckets in pieces of at most ``reduce_bucket_size`` elements (a bucket
        larger than that alone): where sub-groups are stepped during backward, each piece
        reduced lets its sub-groups step while the rest of the unit's backward runs."""
        pieces = [[run[0]]]
        for index in run[1:]:
            if self._run_size(pieces[-1]) + self.buckets[index].size <= self._reduce_capacity:
                pieces[-1].append(index)
            else:
                pieces.append([index])
        return pieces

    def _make_reducer(self, *, scatter: bool, scatter_method: str, device, scale: float):
        """The reducer over the runs: a partitioned run laid out rank by rank (rank r's part is
        its parameters' shards r back to back, the layout a unit's gather reads), so its one
        reduce-scatter lands in the run's flat shard gradient."""
        plan = self.plan
        count = len(self.params)
        param_bucket, param_offset, rank_major = [0] * count, list(plan.param_offset), [0] * count
        members: list[list[int]] = [[] for _ in self.buckets]
        for param, bucket in enumerate(plan.param_bucket):
            members[bucket].append(param)
        sizes, groups = [], []
        for run_index, run in enumerate(self._runs):
            offset = 0
            partitioned = self._partitioned(self.buckets[run[0]])
            for bucket in run:
                for param in members[bucket]:
                    param_bucket[param] = run_index
                    if partitioned:
                        param_offset[param] = offset
                        rank_major[param] = self.buckets[bucket].owned_size
                offset += self.buckets[bucket].owned_size
            sizes.append(sum(plan.bucket_sizes[b] for b in run))
            groups.append(plan.bucket_groups[run[0]])
        reduction = BucketPlan(
            param_bucket, param_offset, list(plan.param_numel), sizes, groups, plan.world_size
        )
        reducer = make_gradient_reducer(
            self.group,
            reduction,
            scatter=scatter,
            scatter_method=scatter_method,
            device=device,
            rank_major=rank_major,
        )
        reducer = logged_if_enabled(reducer, reduction, self.group)  # only with comms_logger on
        reducer.accumulate_into(self._run_grads, scale)
        # Once the first k runs are reduced, the buckets before the first bucket of any later
        # run are final (a suffix minimum over the runs' first buckets).
        self._final_after_runs = [len(self.buckets)] * (len(self._runs) + 1)
        for index in reversed(range(len(self._runs))):
            self._final_after_runs[index] = min(
                self._final_after_runs[index + 1], self._runs[index][0]
            )
        return reducer

    def buckets_reduced(self) -> int:
        return self._final_after_runs[self.reducer.harvested()]

    @staticmethod
    def _partitioned(bucket: _Bucket) -> bool:
        return len(bucket.params) == 1 and pp.is_partitioned(bucket.params[0])

    def _view_params_in_flat(self, bucket: _Bucket) -> None:
        if not self._partitioned(bucket):
            super()._view_params_in_flat(bucket)
            for param in bucket.params:  # a persistent parameter's ds_tensor is itself
                if pp.is_zero_param(param):
                    param.ds_tensor = param.data

    def _master_slice(self, bucket: _Bucket) -> torch.Tensor:
        if not self._partitioned(bucket):
            return super()._master_slice(bucket)
        param = bucket.params[0]
        shard = pp.read_shard(param)
        if getattr(param, "ds_home", None) is not None:
            return shard.float().clone()  # the shard's home is not the optimizer's
        return shard if shard.dtype == torch.float32 else shard.float()

    def owned_slice_of_params(self, bucket: _Bucket, device: torch.device) -> torch.Tensor:
        if not self._partitioned(bucket):
            return super().owned_slice_of_params(bucket, device)
        return pp.read_shard(bucket.params[0]).float().clone()

    def owned_device_target(self, bucket: _Bucket) -> torch.Tensor:
        if not self._partitioned(bucket):
            return super().owned_device_target(bucket)
        shard = bucket.params[0].ds_tensor
        if shard.device.type == "meta":  # on NVMe: staged on the host, then stored
            return torch.empty(shard.numel(), dtype=shard.dtype)
        return shard

    def bucket_step_calls(self) -> list[list[int]]:
        """A partitioned bucket has nothing to gather after its step (the next forward gathers
        its shard), so stepping bucket by bucket to overlap gathers gains nothing there and
        costs one optimizer call per parameter (194 on the deep model: its ZeRO-3 step took
        twice ZeRO-2's). The partitioned buckets take one call together (the same update with
        an optimizer that steps every tensor on its own: state and step count per tensor);
        persistent buckets are still stepped one at a time, each gather overlapping the next
        update."""
        if self._step_calls is None:  # fixed at set-up
            together = [i for i, b in enumerate(self.buckets) if self._partitioned(b)]
            calls = [together] if together else []
            calls += [[i] for i, b in enumerate(self.buckets) if not self._partitioned(b)]
            self._step_calls = calls
        return self._step_calls

    def launch_gather(self, bucket: _Bucket, master: torch.Tensor):
        if not self._partitioned(bucket):
            return super().launch_gather(bucket, master)
        # The next forward gathers the shard; only a low-precision copy needs writing.
        param = bucket.params[0]
        if getattr(param, "ds_home", None) is not None or (
            param.ds_tensor.data_ptr() != master.data_ptr()
        ):
            pp.store_shard(param, master.detach())
        return bucket, None, [], True


class ZeroStage3:
    """The ``ZeroStage`` of stage 3 (see the module docstring). ``optimizer`` None: inference
    or evaluation only (parameters partitioned and gathered, nothing trained)."""

    stage = 3

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer,
        param_groups: list[dict] | None,
        *,
        zero,
        group,
        device: torch.device,
        dtype: torch.dtype | None,
        gradient_clipping: float = 0.0,
        loss_scaler=None,
        offload=None,
        device_optimizer=None,
        param_offload=None,
    ):
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        partition_module(
            module,
            group,
            device=device,
            dtype=dtype,
            param_threshold=int(zero.param_persistence_threshold),
            model_threshold=int(zero.model_persistence_threshold),
        )
        self.param_home = None
        self._stepping_next = True  # whether the backward under way ends with a step
        if param_offload is not None:
            self.param_home = param_offload.make_home(device, rank=self.rank)
            adopted = [
                p
                for p in module.parameters()
                if pp.is_partitioned(p) and getattr(p, "ds_home", None) is None
            ]
            try:
                self.param_home.check_fits(adopted)
                for param in adopted:
                    self.param_home.adopt(param)
            except BaseException:
                self.param_home.close()  # shards adopted so far go back to the device
                raise
        self.coordinator = ParameterCoordinator(
            module,
            group,
            prefetch_bucket_size=zero.prefetch_bucket_size,
            max_live_parameters=zero.max_live_parameters,
            max_reuse_distance=zero.max_reuse_distance,
            unit_min_numel=zero.unit_min_numel,
        )
        self.partitioned = None
        if optimizer is None:
            return
        try:
            self.partitioned = Stage3Optimizer(
                optimizer,
                param_groups,
                model_order={id(p): i for i, p in enumerate(module.parameters())},
                unit_of_param=self.coordinator.unit_of_param(),
                stage=3,
                group=group,
                reduce_bucket_size=int(zero.reduce_bucket_size),
                reduce_scatter=zero.reduce_scatter,
                gradient_clipping=gradient_clipping,
                loss_scaler=loss_scaler,
                offload=offload,
                device_optimizer=device_optimizer,
            )
            self.coordinator.hand_gradients_to(
                self.partitioned.take_over_grad_hooks(self.coordinator.params_with_grad_hooks())
            )
        except BaseException:
            self.coordinator.destroy()  # no hooks left behind on the model
            if self.param_home is not None:
                self.param_home.close()
            raise

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
    the small ones persistent, and moves and casts buffers and shards to ``device``/``dtype``."""
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
            if dtype is not None and buffer.is_floating_point():
                moved = moved.to(dtype)
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
