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
import weakref
from collections.abc import Callable

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
from . import deepspeed_group_views as ds_views
from .in_place_grads import InPlaceGradients, grads_can_stay_in_place
from .loss_scale_state import LossScaleConfigView
from .offload.optimizer_offload import OptimizerOffload
from .offload.stepping import OffloadedStepper, make_device_optimizer
from .param_fragments import ParamFragments
from .param_gathers import MasterGathers
from .shard_checkpoint_state import ShardCheckpoint
from .shard_gather import backend_for
from .shard_norms import ShardGradientChecks
from .shard_set import Bucket, ShardSet
from .stage_setup import init_stage_fields, optimizer_over_masters
from .steppers import InMemoryStepper
from .unused_parameters import UnusedParameterCheck


class ZeroPartitionedOptimizer(MasterGathers):
    """One engine's ZeRO stage 0-2, composed of its ``ShardSet`` (plan, buckets, fp32 master
    shards, shard gradients, home), a stepper (``steppers.py``: in memory, or offloaded with the
    delayed update and steps during backward), the checkpoint view of its shards
    (``shard_checkpoint_state.py``), its parameters' fragments (``param_fragments.py``) and the
    C++ reducer, which it drives from the gradient hooks. It is the ``ParamGathers``
    (``param_gathers.py``) its stepper writes updated values through."""

    # DeepSpeed's names for the groups and fp32 partitions, read-only (deepspeed_group_views.py).
    bit16_groups = property(ds_views.bit16_groups)
    fp16_groups = property(ds_views.fp16_groups)
    single_partition_of_fp32_groups = fp32_partitioned_groups_flat = property(ds_views.fp32_shards)

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
        for bucket in self.buckets:
            self._view_params_in_flat(bucket)
        device = self.params[0].device
        # Per-element optimizer state tensors a home reserves room for (Adam's two).
        self.home = (offload or OptimizerOffload()).make_home(
            [b.owned_size for b in self.buckets], device, rank=self.rank, state_slots=2
        )
        self.masters, self.shard_grads = self._make_masters(device)
        self.shards = ShardSet(
            params=self.params,
            plan=self.plan,
            buckets=self.buckets,
            masters=self.masters,
            shard_grads=self.shard_grads,
            home=self.home,
            stage=stage,
            group=group,
            rank=self.rank,
            world_size=self.world_size,
        )
        on_device = getattr(self.home, "on_device", None)  # a partial offload's device buckets
        offloaded = [b for b in range(len(self.buckets)) if b not in set(on_device or ())]
        master_groups = self._master_param_groups(param_groups, offloaded)
        device_part = make_device_optimizer(
            device_optimizer,
            on_device,
            optimizer,
            offload is not None and offload.delayed_update_after is not None,
            self._master_param_groups(param_groups, list(on_device or ())),
        )
        optimizer = optimizer_over_masters(optimizer, master_groups)
        # The stepper and the checkpoint view call back through a proxy: no reference cycle, so
        # the stage is freed as soon as its engine lets go of it.
        gathers = weakref.proxy(self)
        if offload is None:
            self.stepper = InMemoryStepper(self.shards, gathers, optimizer)
        else:
            self.stepper = OffloadedStepper(
                self.shards,
                gathers,
                optimizer,
                offload,
                device_optimizer=device_part,
                gradient_clipping=self.gradient_clipping,
                loss_scaled=self.loss_scaler is not None,
            )
        self.checkpoint_state = ShardCheckpoint(self.shards, self.stepper, gathers)
        self.gradient_checks = ShardGradientChecks(self.shards, norm_group, counts_in_norm)
        self.home.attach(self.masters, optimizer)

        scale = 1.0 / (grad_divisor or self.world_size)
        self.reducer = self._make_reducer(
            scatter=not owned_whole,
            scatter_method="auto" if reduce_scatter else "all_reduce",
            device=device,
            scale=scale,
        )
        # Stage 0: the parameters' .grad are views of the flat gradients, reduced in place.
        self._in_place_grads = (
            InPlaceGradients(
                self.buckets,
                self.shard_grads,
                [self.plan.members(b) for b in range(len(self.buckets))],
                group=self.group,
                world_size=self.world_size,
                scale=scale,
            )
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
        self._boundary_backward = False
        self.fragments = ParamFragments(self.shards, self.stepper, loss_scaler)
        self.fragments.link()  # deepspeed_cpp.utils.safe_get_full_fp32_param & co.
        # The engine's wall-clock timers, set at ZeRO-3 with ``wall_clock_breakdown`` (None:
        # nothing timed, no cost in the gradient hooks).
        self.timers = None
        # ignore_unused_parameters = false (set by build.py where DeepSpeed checks it).
        self.unused_parameter_check: UnusedParameterCheck | None = None

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

    def _make_buckets(self, owned_whole: bool) -> list[Bucket]:
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
                Bucket(
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

    def _master_slice(self, bucket: Bucket) -> torch.Tensor:
        if bucket.flat is not None and bucket.flat.dtype == torch.float32:
            # fp32 parameters are their own master weights: the master slice is this rank's
            # part of the flat parameters, so the optimizer updates the parameters in place
            # and the all-gather only brings the other ranks' slices.
            return bucket.flat.narrow(0, bucket.owned_start, bucket.owned_size)
        return self.owned_slice_of_params(bucket, self.params[0].device)

    def _view_params_in_flat(self, bucket: Bucket) -> None:
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

    def owned_slice_of_params(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
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
            if self.unused_parameter_check is not None:
                self.unused_parameter_check.saw_gradient(index)
            if self._reduce_during_backward:
                self._hand_over(index, param)
            elif self._in_place_grads is not None:
                self._in_place_grads.grad_ready(index, param)
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
            self.stepper.after_reduction()
        self._handed.add(index)
        if self.stage >= 2 or self._fp32_accumulators is not None:
            param.grad = None  # the reducer holds a copy; the full gradient is not kept

    # --- backward -----------------------------------------------------------------------------
    def begin_backward(self, boundary: bool) -> None:
        """Stages 2/3 reduce every micro-step; 0/1 accumulate locally until the boundary."""
        if self.stage == 0 and self.shards.masters_cleared():
            # The script stepped and cleared the optimizer initialize handed back itself
            # (optimizer.step(); optimizer.zero_grad()): start from zero as after zero_grad().
            self._shard_grads_zero_pending = True
        if self._in_place_grads is not None and not all(
            map(self.params_still_view_flat, self.buckets)
        ):
            self._in_place_grads = None  # data replaced (module.half()...): reduce as usual
        if self._in_place_grads is not None:  # autograd accumulates into the flat gradients
            self._boundary_backward, self.fragments.gradients_ready = boundary, False
            if self._shard_grads_zero_pending:
                self._apply_pending_zero()
                self._in_place_grads.install()
            else:
                self._in_place_grads.adopt()
            if boundary:
                self._in_place_grads.begin_reduction()
            return
        self._reduce_during_backward = self.stage >= 2 or boundary
        self._boundary_backward = boundary
        self.fragments.gradients_ready = False
        self.stepper.begin_backward(boundary and self._reduce_during_backward)
        if self._reduce_during_backward:
            self.reducer.set_overwrite(self._shard_grads_zero_pending)

    def end_backward(self) -> None:
        """Reduces what the hooks have not, and accumulates this rank's shard of the gradients."""
        if self._in_place_grads is not None:
            self._in_place_grads.adopt()
            if self._boundary_backward:
                self._in_place_grads.finish_reduction()
                self.shards.link_master_grads()  # for a script stepping the handed-back optimizer
            self.fragments.gradients_ready = self._boundary_backward
            return
        self.stepper.end_backward()
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
        self.fragments.gradients_ready = self._boundary_backward
        if self._boundary_backward and self.stage == 0:
            self.shards.link_master_grads()  # for a script stepping the handed-back optimizer

    def accumulated_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """``param``'s gradient accumulated locally over the micro-steps since the last
        reduction (stages 0/1 between boundaries): ``param.grad``, or its fp32 accumulator for a
        low-precision model. The pipeline engine sums tied weights' copies in it."""
        if self._fp32_accumulators is not None:
            return self._fp32_accumulators[self.fragments.position_of[id(param)]]
        return param.grad

    # --- step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Unscale, check overflow, clip, step the shards, gather the parameters back.

        Returns False when the step was skipped: an fp16 gradient overflowed on some rank, or
        the global gradient norm (the same on every rank) is not finite
        (``runtime/nonfinite_gradients.py``).
        """
        if self.unused_parameter_check is not None:
            self.unused_parameter_check.check_and_reset()  # before any collective of the step
        self._apply_pending_zero()
        if self.loss_scaler is not None:
            if self.gradient_checks.overflow_on_any_rank():
                self.loss_scaler.update_scale(True)
                self.skipped_steps += 1
                self.zero_grad()
                return False
            inverse_scale = 1.0 / self.loss_scaler.loss_scale
            if inverse_scale != 1.0:
                for grad in self.shard_grads:
                    grad.mul_(inverse_scale)
        norms = self.stepper.shard_grad_norms()
        self.global_grad_norm = self.gradient_checks.global_norm(norms)
        if not math.isfinite(self.global_grad_norm):
            return self._skip_nonfinite_step()
        if self.gradient_clipping > 0.0:
            coefficient = self.gradient_clipping / (self.global_grad_norm + 1e-6)
            if coefficient < 1.0:
                for grad in self.shard_grads:
                    grad.mul_(coefficient)
        self.stepper.step_and_gather()
        if self.loss_scaler is not None:
            self.loss_scaler.update_scale(False)
        self.zero_grad()
        return True

    def _skip_nonfinite_step(self) -> bool:
        """Steps nothing and clears the gradients; what a ``step_during_backward`` worker
        stepped with this step's gradients is undone first."""
        self.stepper.discard_early_steps()
        if self.loss_scaler is not None:  # a norm past float's range: an overflow all the same
            self.loss_scaler.update_scale(True)
        self.skipped_steps += 1
        self.zero_grad()
        return False

    def zero_grad(self) -> None:
        self.fragments.gradients_ready = False
        if self._fp32_accumulators is not None:
            self._fp32_accumulators = [None] * len(self.params)
        self._shard_grads_zero_pending = True
        for param in self.params:
            param.grad = None

    def step_gradients(self) -> list[torch.Tensor]:
        """This step's shard gradients (zeros where nothing was reduced since ``zero_grad``)."""
        self._apply_pending_zero()
        return self.shard_grads

    def zero_grads_now(self) -> None:
        """Applies a pending ``zero_grad()`` now rather than at the next backward: the pipeline
        calls it before a blocking receive, where the stage would otherwise wait idle."""
        if self._shard_grads_zero_pending:
            self._apply_pending_zero()
            if self._in_place_grads is not None:
                self._in_place_grads.install()

    def _apply_pending_zero(self) -> None:
        # Only a step with no reduction since zero_grad() reads shard gradients still pending.
        if self._shard_grads_zero_pending:
            for grad in self.shard_grads:
                grad.zero_()
            self._shard_grads_zero_pending = False

    # --- what code holding "the optimizer" expects ------------------------------------------
    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer stepping the master shards (the user's object, re-pointed)."""
        return self.stepper.optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def loss_scale_config(self) -> LossScaleConfigView:
        """DeepSpeed's loss-scale attributes of its ZeRO optimizers (``loss_scale_state.py``)."""
        return LossScaleConfigView(self.loss_scaler)

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scale_config.dynamic_loss_scale

    @property
    def state(self):
        return self.optimizer.state

    # --- the stepper's, for the engine and the stages composing sets ----------------------------
    @property
    def steps_during_backward(self) -> bool:
        """Whether optimizer sub-groups may be stepped inside backward (``backward_steps.py``)."""
        return self.stepper.steps_during_backward

    def apply_pending_update(self) -> None:
        self.stepper.apply_pending_update()

    def discard_pending_update(self) -> None:
        self.stepper.discard_pending_update()

    def write_params_from_masters(self) -> None:
        self.stepper.write_params_from_masters()

    def use_optimizer(self, optimizer, offload: OptimizerOffload | None) -> None:
        """Steps the masters with ``optimizer``, made over several sets' masters by the stage
        composing them (``moe_stage.py``, which drives host steps through ``stepper``)."""
        self.stepper.use_optimizer(optimizer, offload)
        self.home.attach(self.masters, optimizer)

    # --- checkpoints: the shards' (``shard_checkpoint_state.py``) --------------------------------
    def layout(self):
        return self.checkpoint_state.layout()

    def layout_parts(self, key: str = "", origins: tuple[int, ...] | None = None):
        """This stage as one ``LayoutPart`` (``key``, ``origins``: see ``moe_stage.py``)."""
        return self.checkpoint_state.layout_parts(key, origins)

    def owned_ranges(self) -> list[tuple[int, int]]:
        return self.checkpoint_state.owned_ranges()

    def shard_state(self) -> list[dict]:
        return self.checkpoint_state.shard_state()

    def stream_shard_state(self) -> list[dict]:
        return self.checkpoint_state.stream_shard_state()

    def first_state(self) -> dict | None:
        return self.checkpoint_state.first_state()

    def load_shard_state(self, masters: list[torch.Tensor], states: list[dict] | None) -> None:
        """Replaces the master slices (and optimizer state); pending gradients are dropped."""
        self.checkpoint_state.load_shard_state(masters, states)
        self.zero_grad()

    def refresh_masters_from_params(self) -> None:
        """Re-reads the master slices from the parameters; pending gradients are dropped."""
        self.checkpoint_state.refresh_masters_from_params()
        self.zero_grad()

    # --- accounting ---------------------------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state and fp32 master shards this rank holds in memory (with
        offload: the host bytes of masters, state and gradient buffers, or NVMe's swap buffers)."""
        return self.stepper.state_bytes()

    def describe(self) -> str:
        where = (
            "" if self.home.kind == "none" else f", optimizer state offloaded to {self.home.kind}"
        )
        if self._in_place_grads is not None:
            if self._in_place_grads.reduces:
                return "gradients accumulated and all-reduced in place"
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
        self.fragments.unlink()
        try:
            self.apply_pending_update()
        finally:
            self.stepper.close()
            self.home.close()
