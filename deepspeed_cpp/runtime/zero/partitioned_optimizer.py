"""ZeRO stages 0, 1 and 2 over flat fp32 master buckets.

Every trainable parameter is planned once, at construction, into a flat bucket (csrc/zero's
planner: same plan on every rank, buckets never mix parameter groups). Each bucket is padded to a
multiple of the world size and split into equal shards; rank r owns shard r of every bucket:

- stage 0: every rank owns whole buckets; gradients are all-reduced;
- stage 1: a rank keeps fp32 master weights and optimizer state for its shards only; the full
  gradients accumulate locally and are reduce-scattered once, at the accumulation boundary;
- stage 2: also gradients: each one is handed to the C++ reducer as soon as autograd has it
  (a post-accumulate-grad hook), reduce-scattered bucket by bucket while backward goes on, and
  freed; the rank accumulates only its shard across micro-steps.

The wrapped ``torch.optim.Optimizer`` (ours or the user's) steps the owned fp32 shards, and the
updated shards are all-gathered back into the model's parameters (in their own dtype). Because
the Adam-family update is element-wise, stepping flat shards equals stepping each parameter.

As in DeepSpeed, the parameters of a bucket are views of one flat tensor in their dtype, so the
all-gather writes them in place with no copy afterwards (a parameter whose data was replaced
since, e.g. by ``module.half()``, is copied into instead); fp32 parameters are their own master
weights (a rank's master slice is its part of the flat parameters).

A parameter that gets no gradient on any rank in a step is treated as having a zero gradient, as
DeepSpeed does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...comm.reducer_tap import logged_if_enabled
from ...ops.zero import (
    BucketPlan,
    flatten_into,
    make_gradient_reducer,
    plan_buckets,
)
from ...utils.timer import REDUCE_SCATTER_SUBMIT_TIMER, REDUCE_SCATTER_WAIT_TIMER, timed
from .chunked_step import can_step_in_chunks, step_in_chunks
from .deepspeed_group_views import DeepSpeedGroupViews
from .in_place_grads import InPlaceGradients, grads_can_stay_in_place
from .loss_scale_state import LossScaleState
from .norm_ranges import counted_ranges, norm_of_ranges
from .offload.optimizer_offload import OptimizerOffload
from .offload.stepping import OffloadedStepping
from .param_fragments import ParamFragments
from .param_gathers import MasterGathers
from .shard_checkpoint_state import ShardCheckpointState
from .shard_gather import backend_for
from .stage_setup import init_stage_fields, optimizer_over_masters


@dataclass
class _Bucket:
    """The parameters of one bucket and the slice of it this rank owns."""

    params: list[torch.nn.Parameter]
    offsets: list[int]
    size: int
    owned_start: int
    owned_size: int
    gather_dtype: torch.dtype  # the parameters' dtype where they share one, else fp32
    # The flat tensor the parameters view (None where they differ in dtype or device), and the
    # data pointers they had when made views: a mismatch means a parameter's data was replaced.
    flat: torch.Tensor | None = None
    view_pointers: tuple[int, ...] = ()


class ZeroPartitionedOptimizer(
    OffloadedStepping,
    MasterGathers,
    ShardCheckpointState,
    ParamFragments,
    LossScaleState,
    DeepSpeedGroupViews,
):
    """Owns the plan, fp32 master shards, shard gradients and the reducer for one engine."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer | Callable[[list[dict]], torch.optim.Optimizer],
        param_groups: list[dict] | None = None,
        *,
        stage: int,
        group: dist.ProcessGroup,
        reduce_bucket_size: int,
        gradient_clipping: float = 0.0,
        loss_scaler=None,
        reduce_scatter: bool = True,
        offload: OptimizerOffload | None = None,
        device_optimizer: Callable[[list[dict]], torch.optim.Optimizer] | None = None,
        grad_divisor: int | None = None,
        norm_group: dist.ProcessGroup | None = None,
        counts_in_norm: Callable[[torch.nn.Parameter], bool] | None = None,
    ):
        """`optimizer` is either a torch optimizer over the model's parameters (the user's: its
        param groups are re-pointed at the master shards in place) or a factory that builds one
        from param groups of master shards (a config optimizer); `param_groups` (dicts with
        "params" and hyper-parameters) is then required. `reduce_scatter=False` (DeepSpeed's
        ``zero_optimization.reduce_scatter``) reduces stage 1/2 gradients with all-reduce.
        ``offload`` puts the master shards and optimizer state on the host or NVMe (see
        ``offload/optimizer_homes.py``); with ``ratio`` < 1 the buckets left on the device are
        stepped by ``device_optimizer`` (a factory like a config ``optimizer``).
        ``grad_divisor`` (default: the size of ``group``) is what the summed gradients are divided
        by: expert parameters are reduced over their expert-data-parallel group but averaged over
        the whole data-parallel world (``moe_stage.py``). ``norm_group`` (model parallelism,
        ``runtime/model_parallel.py``): the gradient norm's partial sums are summed over it too,
        after ``group``, each rank adding the parameters for which ``counts_in_norm`` is true (all
        when None), so that the norm and the skip decision are the whole model's."""
        if stage not in self.STAGES:
            raise ValueError(f"{type(self).__name__} handles stages {self.STAGES}, got {stage}")
        param_groups = init_stage_fields(
            self,
            optimizer,
            param_groups,
            stage=stage,
            group=group,
            gradient_clipping=gradient_clipping,
            loss_scaler=loss_scaler,
        )

        owned_whole = stage == 0
        if offload is not None and owned_whole:
            raise ValueError(
                f"zero_optimization.offload_optimizer.device = {offload.device!r} needs ZeRO "
                f"stage 1, 2 or 3 (it offloads the partitioned optimizer state); got stage 0"
            )
        self.params, self.plan = self._plan(param_groups, reduce_bucket_size, owned_whole)
        self.buckets = self._make_buckets(owned_whole)
        self.norm_group = norm_group
        self._norm_ranges = counted_ranges(self.buckets, counts_in_norm)
        for bucket in self.buckets:
            self._view_params_in_flat(bucket)
        device = self.params[0].device
        # Per-element optimizer state tensors a home reserves room for (Adam's two).
        self.home = (offload or OptimizerOffload()).make_home(
            [b.owned_size for b in self.buckets], device, rank=self.rank, state_slots=2
        )
        self.masters, self.shard_grads = self._make_masters(device)
        self._delayed_requested = offload is not None and offload.delayed_update_after is not None
        on_device = getattr(self.home, "on_device", None)  # a partial offload's device buckets
        offloaded = [b for b in range(len(self.buckets)) if b not in set(on_device or ())]
        master_groups = self._master_param_groups(param_groups, offloaded)
        self._device_optimizer = self._make_device_optimizer(
            device_optimizer, param_groups, on_device, optimizer
        )
        self.optimizer = optimizer_over_masters(optimizer, master_groups)
        # Optimizers that step every tensor on its own (ours) can step bucket by bucket.
        self._step_per_bucket = bool(getattr(self.optimizer, "steps_tensors_independently", False))
        self._delayed = self._check_offload(offload)
        self._backward_steps = self._make_backward_steps(offload)
        self.home.attach(self.masters, self.optimizer)

        scale = 1.0 / (grad_divisor or self.world_size)
        self.reducer = self._make_reducer(
            scatter=not owned_whole,
            scatter_method="auto" if reduce_scatter else "all_reduce",
            device=device,
            scale=scale,
        )
        # One replica at stage 0: the parameters' .grad are views of the flat gradients.
        self._in_place_grads = (
            InPlaceGradients(self.buckets, self.shard_grads)
            if grads_can_stay_in_place(self, scale)
            else None
        )
        self._gather_by_broadcast = backend_for(group, device) == "gloo"
        # Shard gradients are zeroed lazily: the first reduction after zero_grad() writes them
        # instead of adding to zeros (a full pass over every shard saved per step).
        self._shard_grads_zero_pending = False
        self._handed: set[int] = set()
        self._reduce_during_backward = False
        low_precision = any(p.dtype != torch.float32 for p in self.params)
        self._fp32_accumulators: list[torch.Tensor | None] | None = (
            [None] * len(self.params) if low_precision and stage in (0, 1) else None
        )
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(index))
            for index, p in enumerate(self.params)
        ]
        self._link_fragment_owners()  # deepspeed_cpp.utils.safe_get_full_fp32_param & co.
        # The engine's wall-clock timers, set at ZeRO-3 with ``wall_clock_breakdown`` (None:
        # nothing timed, no cost in the gradient hooks).
        self.timers = None

    STAGES = (0, 1, 2)
    trains = True

    # --- construction -------------------------------------------------------------------------
    def _plan(
        self, param_groups: list[dict], reduce_bucket_size: int, owned_whole: bool
    ) -> tuple[list[torch.nn.Parameter], BucketPlan]:
        """The trainable parameters in the order their gradients usually become ready (reverse
        registration order), grouped by param group so that a bucket never mixes groups, and
        their bucket plan."""
        ordered: list[tuple[int, torch.nn.Parameter]] = []
        for group_index, param_group in enumerate(param_groups):
            trainable = [p for p in param_group["params"] if p.requires_grad]
            ordered.extend((group_index, p) for p in reversed(trainable))
        if not ordered:
            raise ValueError("the optimizer has no trainable parameters (requires_grad=True)")
        plan = plan_buckets(
            [p.numel() for _, p in ordered],
            [g for g, _ in ordered],
            capacity=max(1, int(reduce_bucket_size)),
            world_size=1 if owned_whole else self.world_size,
        )
        return [p for _, p in ordered], plan

    def _make_buckets(self, owned_whole: bool) -> list[_Bucket]:
        buckets = []
        for b, size in enumerate(self.plan.bucket_sizes):
            members = self.plan.members(b)
            if owned_whole:
                start, owned = 0, size
            else:
                owned = size // self.world_size
                start = self.rank * owned
            params = [self.params[p] for p in members]
            dtypes = {p.dtype for p in params}
            buckets.append(
                _Bucket(
                    params=params,
                    offsets=[self.plan.param_offset[p] for p in members],
                    size=size,
                    owned_start=start,
                    owned_size=owned,
                    # Low-precision parameters are gathered in their own dtype: half the bytes,
                    # and the same values as gathering fp32 and casting afterwards.
                    gather_dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32,
                )
            )
        return buckets

    def _make_masters(self, device) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
        masters, grads = [], []
        shard_grads = self._make_shard_grads(device)
        for bucket in self.buckets:
            values = self.home.make_master(len(masters), self._master_slice(bucket))
            master = torch.nn.Parameter(values, requires_grad=True)
            # The reducer writes shard gradients on the device; offloaded masters get theirs
            # copied to the host for each step.
            grad = shard_grads[len(masters)]
            if not self.home.offloaded(len(masters)):
                master.grad = grad
            masters.append(master)
            grads.append(grad)
        return masters, grads

    def _make_shard_grads(self, device) -> list[torch.Tensor]:
        """One fp32 gradient per bucket: this rank's shard of it, where the reducer adds."""
        return [torch.zeros(b.owned_size, dtype=torch.float32, device=device) for b in self.buckets]

    def _make_reducer(self, *, scatter: bool, scatter_method: str, device, scale: float):
        """The C++ reducer over the bucket plan; each reduced bucket is averaged (``scale``)
        straight into this rank's shard gradient as soon as its collective completes, during
        backward."""
        reducer = make_gradient_reducer(
            self.group, self.plan, scatter=scatter, scatter_method=scatter_method, device=device
        )
        reducer = logged_if_enabled(reducer, self.plan, self.group)  # only with comms_logger on
        reducer.accumulate_into(self.shard_grads, scale)
        return reducer

    def buckets_reduced(self) -> int:
        """How many leading buckets have their shard gradient reduced in this backward (final
        at an accumulation boundary)."""
        return self.reducer.harvested()

    def _master_slice(self, bucket: _Bucket) -> torch.Tensor:
        if bucket.flat is not None and bucket.flat.dtype == torch.float32:
            # fp32 parameters are their own master weights: the master slice is this rank's
            # part of the flat parameters, so the optimizer updates the parameters in place
            # and the all-gather only brings the other ranks' slices.
            return bucket.flat.narrow(0, bucket.owned_start, bucket.owned_size)
        return self._owned_slice_of_params(bucket, self.params[0].device)

    def _view_params_in_flat(self, bucket: _Bucket) -> None:
        dtypes = {p.dtype for p in bucket.params}
        devices = {p.device for p in bucket.params}
        if len(dtypes) != 1 or len(devices) != 1:
            return
        flat = torch.zeros(bucket.size, dtype=dtypes.pop(), device=devices.pop())
        flatten_into([p.detach() for p in bucket.params], flat, bucket.offsets)
        for param, offset in zip(bucket.params, bucket.offsets):
            param.data = flat.narrow(0, offset, param.numel()).view(param.shape)
        bucket.flat = flat
        bucket.view_pointers = tuple(p.data_ptr() for p in bucket.params)

    @staticmethod
    def _params_still_view_flat(bucket: _Bucket) -> bool:
        return bucket.flat is not None and all(
            p.data_ptr() == pointer and p.dtype == bucket.flat.dtype
            for p, pointer in zip(bucket.params, bucket.view_pointers)
        )

    def _owned_slice_of_params(self, bucket: _Bucket, device: torch.device) -> torch.Tensor:
        """The model parameters' current values over this rank's slice of `bucket`, in fp32."""
        flat = torch.zeros(bucket.size, dtype=torch.float32, device=device)
        flatten_into([p.detach() for p in bucket.params], flat, bucket.offsets)
        return flat.narrow(0, bucket.owned_start, bucket.owned_size).clone()

    def _master_param_groups(self, param_groups: list[dict], buckets: list[int]) -> list[dict]:
        """The given param groups' hyper-parameters over this rank's master shards of
        ``buckets``."""
        by_group: dict[int, list[torch.nn.Parameter]] = {}
        for bucket_index in buckets:
            master = self.masters[bucket_index]
            by_group.setdefault(self.plan.bucket_groups[bucket_index], []).append(master)
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": by_group.get(i, [])}
            for i, group in enumerate(param_groups)
        ]

    def _make_hook(self, index: int):
        def hook(param: torch.Tensor) -> None:
            if param.grad is None:
                return
            if self._reduce_during_backward:
                self._hand_over(index, param)
            elif self._fp32_accumulators is not None:
                self._accumulate_fp32(index, param)

        return hook

    def _accumulate_fp32(self, index: int, param: torch.Tensor) -> None:
        # Low-precision models accumulate micro-step gradients in fp32, not in their own dtype.
        accumulator = self._fp32_accumulators[index]
        if accumulator is None:
            self._fp32_accumulators[index] = param.grad.float()
        else:
            accumulator.add_(param.grad)
        param.grad = None

    def _hand_over(self, index: int, param: torch.Tensor) -> None:
        grad = param.grad
        if self._fp32_accumulators is not None and self._fp32_accumulators[index] is not None:
            grad = (
                self._fp32_accumulators[index].add_(grad)
                if grad is not None
                else (self._fp32_accumulators[index])
            )
            self._fp32_accumulators[index] = None
        if grad is not None:
            with (
                named_collective("gradient reduction (a bucket launched during backward)"),
                timed(self.timers, REDUCE_SCATTER_SUBMIT_TIMER),
            ):
                self.reducer.add_grad(index, grad)
            if self._backward_steps is not None and self._backward_steps.active:
                self._step_reduced_sub_groups()
        self._handed.add(index)
        if self.stage >= 2 or self._fp32_accumulators is not None:
            param.grad = None  # the reducer holds a copy; the full gradient is not kept

    # --- backward -----------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """Stages 2/3 reduce every micro-step; 0/1 accumulate locally until the boundary."""
        if self._in_place_grads is not None and not all(
            map(self._params_still_view_flat, self.buckets)
        ):
            self._in_place_grads = None  # data replaced (module.half()...): reduce as usual
        if self._in_place_grads is not None:  # autograd accumulates into the flat gradients
            self._boundary_backward, self._gradients_ready = boundary, False
            if self._shard_grads_zero_pending:
                self._apply_pending_zero()
                self._in_place_grads.install()
            else:
                self._in_place_grads.adopt()
            return
        self._reduce_during_backward = self.stage >= 2 or boundary
        self._boundary_backward = boundary
        self._gradients_ready = False
        if self._backward_steps is not None:
            self._backward_steps.begin_backward(boundary and self._reduce_during_backward)
        if self._reduce_during_backward:
            self.reducer.set_overwrite(self._shard_grads_zero_pending)

    def end_backward(self) -> None:
        """Reduces what the hooks have not, and accumulates this rank's shard of the gradients."""
        if self._in_place_grads is not None:
            self._in_place_grads.adopt()
            self._gradients_ready = self._boundary_backward
            return
        if self._backward_steps is not None:
            self._backward_steps.end_backward()  # the rest is stepped at the step
        if not self._reduce_during_backward:
            return
        for index, param in enumerate(self.params):
            # Stages 0/1: a gradient accumulated in earlier micro-steps whose parameter was not
            # used in this one never fired the hook now, but must be reduced.
            if index not in self._handed:
                self._hand_over(index, param)
        self._handed.clear()
        with named_collective("gradient reduction"), timed(self.timers, REDUCE_SCATTER_WAIT_TIMER):
            self.reducer.finish()  # the shard gradients now hold this micro-step's reduction too
        self._shard_grads_zero_pending = False
        self._reduce_during_backward = False
        # The shard gradients are final (and readable through param_fragments) until the step.
        self._gradients_ready = self._boundary_backward

    def accumulated_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient accumulated locally over the micro-steps since the last
        reduction (stages 0/1 between boundaries): ``param.grad``, or its fp32 accumulator for a
        low-precision model. The pipeline engine sums tied weights' copies in it."""
        if self._fp32_accumulators is not None:
            return self._fp32_accumulators[self._position_of[id(param)]]
        return param.grad

    # --- step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Unscale, check overflow, clip, step the shards, gather the parameters back.

        Returns False when the step was skipped: an fp16 gradient overflowed on some rank, or
        the global gradient norm (the same on every rank) is not finite
        (``runtime/nonfinite_gradients.py``).
        """
        self._apply_pending_zero()
        if self.loss_scaler is not None:
            if self._overflow_on_any_rank():
                self.loss_scaler.update_scale(True)
                self.skipped_steps += 1
                self.zero_grad()
                return False
            inverse_scale = 1.0 / self.loss_scaler.loss_scale
            if inverse_scale != 1.0:
                for grad in self.shard_grads:
                    grad.mul_(inverse_scale)
        self.global_grad_norm = self._global_norm()
        if not math.isfinite(self.global_grad_norm):
            return self._skip_nonfinite_step()
        if self.gradient_clipping > 0.0:
            coefficient = self.gradient_clipping / (self.global_grad_norm + 1e-6)
            if coefficient < 1.0:
                for grad in self.shard_grads:
                    grad.mul_(coefficient)
        self._step_and_gather()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        self.zero_grad()
        return True

    def _skip_nonfinite_step(self) -> bool:
        """Steps nothing and clears the gradients; what a ``step_during_backward`` worker
        stepped with this step's gradients is undone first (``_discard_early_steps``)."""
        self._discard_early_steps()
        if self.loss_scaler is not None:  # a norm past float's range: an overflow all the same
            self.loss_scaler.update_scale(True)
        self.skipped_steps += 1
        self.zero_grad()
        return False

    def zero_grad(self) -> None:
        self._gradients_ready = False
        if self._fp32_accumulators is not None:
            self._fp32_accumulators = [None] * len(self.params)
        self._shard_grads_zero_pending = True
        for param in self.params:
            param.grad = None

    def step_gradients(self) -> list[torch.Tensor]:
        """This step's shard gradients (zeros where nothing was reduced since ``zero_grad``)."""
        self._apply_pending_zero()
        return self.shard_grads

    def _apply_pending_zero(self) -> None:
        # Only a step with no reduction since zero_grad() reads shard gradients still pending.
        if self._shard_grads_zero_pending:
            for grad in self.shard_grads:
                grad.zero_()
            self._shard_grads_zero_pending = False

    def _sum_over_shards(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """Sums ``value`` over the ranks holding other shards (stage 0 holds whole gradients)
        and over the model-parallel ranks holding other parts of the model."""
        if self.stage != 0 and self.world_size > 1:
            with named_collective(what):
                dist.all_reduce(value, group=self.group)
        if self.norm_group is not None:
            with named_collective(f"{what} over the model-parallel group"):
                dist.all_reduce(value, group=self.norm_group)
        return value

    def _overflow_on_any_rank(self) -> bool:
        local = torch.zeros(1, dtype=torch.float32, device=self.shard_grads[0].device)
        for grad in self.shard_grads:
            local += (~torch.isfinite(grad)).any().float()
        return bool(self._sum_over_shards(local, "all_reduce of the overflow flag").item() > 0)

    def _global_norm(self) -> float:
        # One fused read of the shards (float32 norms, as torch's clip_grad_norm_), then the
        # partial sums of squares in float64 across shards and ranks.
        norms = self._shard_grad_norms()
        if self._norm_ranges is not None:  # parameters another model-parallel rank counts
            norms = [
                norm if ranges is None else norm_of_ranges(grad, ranges)
                for norm, grad, ranges in zip(norms, self.shard_grads, self._norm_ranges)
            ]
        squares = torch.stack(norms).double().pow(2).sum().reshape(1)
        total = self._sum_over_shards(squares, "all_reduce of the gradient norm")
        return math.sqrt(float(total.item()))

    def _step_and_gather(self) -> None:
        """Steps the master shards and writes the updated values into every rank's parameters.

        Our CPU optimizers step bucket by bucket, each bucket's all-gather starting as soon as it
        is updated, so that the gather of one overlaps the update of the next. They update each
        tensor on its own (state and step count per tensor) and skip tensors without a gradient,
        so stepping the buckets one at a time equals one step over all. Other optimizers (the
        user's may keep per-group counters) step once, then everything is gathered.
        """
        if self.home.kind != "none":
            self._step_offloaded()
            return
        self._relink_master_grads()
        if not (self._step_per_bucket and self.stage != 0 and len(self.masters) > 1):
            if can_step_in_chunks(self.optimizer):  # torch's Adam: cache-sized pieces
                step_in_chunks(self.optimizer)
            else:
                self.optimizer.step()
            pending = [self._launch_gather(b, m) for b, m in zip(self.buckets, self.masters)]
        else:
            pending = []
            for master in self.masters:
                master.grad = None
            try:
                for bucket, master, grad in zip(self.buckets, self.masters, self.shard_grads):
                    master.grad = grad
                    self.optimizer.step()
                    master.grad = None
                    pending.append(self._launch_gather(bucket, master))
            finally:
                for master, grad in zip(self.masters, self.shard_grads):
                    master.grad = grad
        self._finish_gathers(pending)

    # --- what code holding "the optimizer" expects ------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    # --- accounting ---------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state and fp32 master shards this rank holds in memory (with
        offload: the host bytes of masters, state and gradient buffers, or NVMe's swap buffers)."""
        if self.home.kind != "none" and self._device_optimizer is None:
            return self.home.host_bytes()
        in_memory = [m for i, m in enumerate(self.masters) if not self.home.offloaded(i)]
        total = sum(m.numel() * m.element_size() for m in in_memory)
        if self.home.kind != "none":
            total += self.home.host_bytes()
        optimizer = self.optimizer if self._device_optimizer is None else self._device_optimizer
        # list(): a delayed step may be adding state in its thread; copying a dict's values is
        # one call under the GIL, iterating it is not.
        for state in list(optimizer.state.values()):
            for value in list(state.values()):
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    def describe(self) -> str:
        where = (
            "" if self.home.kind == "none" else f", optimizer state offloaded to {self.home.kind}"
        )
        if self._in_place_grads is not None:
            return "gradients accumulated in place (one replica: nothing to reduce)"
        return f"gradients reduced by {self.reducer.collective()}{where}"

    def full_state_dict(self, module: torch.nn.Module, *, rank0_only: bool) -> dict:
        """Stages 0-2 keep every parameter whole: the module's own state dict."""
        self.apply_pending_update()
        return {} if rank0_only and self.rank != 0 else module.state_dict()

    def load_module_state(self, module: torch.nn.Module, state_dict: dict) -> None:
        """Loads a (full) module state dict into the model's parameters and buffers."""
        self.discard_pending_update()  # its result must not land on the loaded weights
        module.load_state_dict(state_dict, strict=False)

    def destroy(self) -> None:
        """Removes the gradient hooks (a later engine on the same model starts clean), finishes
        a delayed step and removes swap files."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._unlink_fragment_owners()
        try:
            self.apply_pending_update()
        finally:
            if self._backward_steps is not None:
                self._backward_steps.close()
            self.home.close()
