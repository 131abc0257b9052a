"""ZeRO stages 0, 1 and 2 over flat fp32 master buckets (and stage 3's shards, laid out by
``partitioned_buckets.py``): the object that drives a built ``ShardSet``, its reducer and its
stepper through backward and the step.

Every trainable parameter is planned once, when the stage is built (``shard_set_builder.py``),
into a flat bucket (csrc/zero's planner: same plan on every rank, buckets never mix parameter
groups). Each bucket is padded to a multiple of the world size and split into equal shards; rank
r owns shard r of every bucket:

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
from ...utils.timer import REDUCE_SCATTER_SUBMIT_TIMER, REDUCE_SCATTER_WAIT_TIMER, timed
from . import deepspeed_group_views as ds_views
from .in_place_grads import InPlaceGradients
from .loss_scale_state import LossScaleConfigView
from .offload.optimizer_offload import OptimizerOffload
from .param_fragments import ParamFragments
from .param_gathers import params_view_flat
from .shard_checkpoint_state import ShardCheckpoint
from .shard_norms import ShardGradientChecks
from .shard_set import ParamGathers, ShardSet
from .stage_setup import set_stage_fields
from .steppers import InMemoryStepper
from .unused_parameters import UnusedParameterCheck


@dataclass
class StageParts:
    """What ``shard_set_builder.build_zero_stage`` builds for a stage: its ``ShardSet``, the C++
    reducer over it, the ``ParamGathers`` writing updated masters into the parameters, the
    stepper, and (stage 0 where gradients can stay in their flat buffers) the in-place
    gradients that replace the reducer's copies."""

    shards: ShardSet
    reducer: object
    gathers: ParamGathers
    stepper: InMemoryStepper
    in_place_grads: InPlaceGradients | None


class ZeroPartitionedOptimizer:
    """One engine's ZeRO stage 0-3 optimizer, composed of its ``ShardSet`` (plan, buckets, fp32
    master shards, shard gradients, home), a stepper (``steppers.py``: in memory, or offloaded
    with the delayed update and steps during backward), the ``ParamGathers`` the stepper writes
    updated values through (``param_gathers.py``; ZeRO-3's in ``partitioned_buckets.py``), the
    checkpoint view of its shards (``shard_checkpoint_state.py``), its parameters' fragments
    (``param_fragments.py``) and the C++ reducer, which it drives from the gradient hooks. All
    but the last three come built (``shard_set_builder.py``)."""

    # DeepSpeed's names for the groups and fp32 partitions, read-only (deepspeed_group_views.py).
    bit16_groups = property(ds_views.bit16_groups)
    fp16_groups = property(ds_views.fp16_groups)
    single_partition_of_fp32_groups = fp32_partitioned_groups_flat = property(ds_views.fp32_shards)

    def __init__(
        self,
        parts: StageParts,
        *,
        gradient_clipping: float = 0.0,
        loss_scaler=None,
        norm_group: dist.ProcessGroup | None = None,
        counts_in_norm: Callable[[torch.nn.Parameter], bool] | None = None,
    ):
        """``parts``: see ``StageParts``; ``norm_group`` and ``counts_in_norm``: see
        ``shard_norms.py``."""
        shards = parts.shards
        set_stage_fields(
            self,
            stage=shards.stage,
            group=shards.group,
            gradient_clipping=gradient_clipping,
            loss_scaler=loss_scaler,
        )
        self.shards, self.reducer, self.gathers = shards, parts.reducer, parts.gathers
        self.stepper = parts.stepper
        # The shard set's fields, under the names code reading a stage uses.
        self.params, self.plan, self.buckets = shards.params, shards.plan, shards.buckets
        self.masters, self.shard_grads, self.home = shards.masters, shards.shard_grads, shards.home
        self.checkpoint_state = ShardCheckpoint(shards, self.stepper, self.gathers)
        self.gradient_checks = ShardGradientChecks(shards, norm_group, counts_in_norm)
        self._in_place_grads = parts.in_place_grads
        # Shard gradients are zeroed lazily: the first reduction after zero_grad() writes them
        # instead of adding to zeros (a full pass over every shard saved per step).
        self._shard_grads_zero_pending = False
        self._handed: set[int] = set()
        self._reduce_during_backward = False
        low_precision = any(p.dtype != torch.float32 for p in self.params)
        self._fp32_accumulators: list[torch.Tensor | None] | None = (
            [None] * len(self.params) if low_precision and self.stage in (0, 1) else None
        )
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(index))
            for index, p in enumerate(self.params)
        ]
        self._boundary_backward = False
        self.fragments = ParamFragments(shards, self.stepper, loss_scaler)
        self.fragments.link()  # deepspeed_cpp.utils.safe_get_full_fp32_param & co.
        # The engine's wall-clock timers, set at ZeRO-3 with ``wall_clock_breakdown`` (None:
        # nothing timed, no cost in the gradient hooks).
        self.timers = None
        # ignore_unused_parameters = false (set by build.py where DeepSpeed checks it).
        self.unused_parameter_check: UnusedParameterCheck | None = None

    trains = True

    # --- gradient hooks -----------------------------------------------------------------------
    def take_over_grad_hooks(self, param_ids: set[int]) -> dict[int, object]:
        """Removes this stage's gradient hooks of the parameters in ``param_ids`` and returns
        what they called, ``id(param)`` -> ``hook(param)``, for ZeRO-3's coordinator to call from
        its own hook on those parameters (``ParameterCoordinator.hand_gradients_to``): autograd
        then runs one Python hook per partitioned parameter instead of two."""
        taken = {}
        for index, param in enumerate(self.params):
            if id(param) in param_ids:
                self._hooks[index].remove()
                taken[id(param)] = self._make_hook(index)
        return taken

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
        if self._in_place_grads is not None and not all(map(params_view_flat, self.buckets)):
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
        if self.stage < 2 and self.fragments.gradients_ready:
            # Another backward after the boundary's, before step(): the shard gradients hold
            # the kept .grad already reduced; handed over again with the new gradients added
            # to it, it would count twice. Stages 2/3 (and the fp32 accumulators) keep none.
            for param in self.params:
                param.grad = None
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

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """DeepSpeed's: per param group, the norm of its reduced gradient as it is now, between
        backward and step (still multiplied by the fp16 loss scale, as DeepSpeed's; collective).
        Scripts debugging clipping read it before and after editing gradients with
        ``safe_set_*_grad``. DeepSpeed's stage 3 has one entry per sub-group (sub_group_size);
        ours one per param group: the norm of the entries is the global norm either way."""
        norms = self.stepper.shard_grad_norms()
        return self.gradient_checks.group_norms(norms)

    @property
    def _global_grad_norm(self) -> float | None:
        """DeepSpeed's name for ``global_grad_norm`` (the last step's, loss scale removed)."""
        return self.global_grad_norm

    def read_local_gradients(self, active: bool) -> None:
        """While ``active`` (inside ``engine.no_sync()``, ``runtime/no_sync.py``),
        ``safe_get_full_grad`` reads each parameter's locally accumulated gradient."""
        self.fragments.local_grad = self.accumulated_grad if active else None

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
                # One op over all shards (stage 3 holds one per parameter: hundreds).
                torch._foreach_mul_(self.shard_grads, inverse_scale)
        norms = self.stepper.shard_grad_norms()
        self.global_grad_norm = self.gradient_checks.global_norm(norms)
        if not math.isfinite(self.global_grad_norm):
            return self._skip_nonfinite_step()
        if self.gradient_clipping > 0.0:
            coefficient = self.gradient_clipping / (self.global_grad_norm + 1e-6)
            if coefficient < 1.0:
                torch._foreach_mul_(self.shard_grads, coefficient)
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
            torch._foreach_zero_(self.shard_grads)
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

    def gather_params(self) -> None:
        """Writes every in-memory master into every rank's parameters (``param_gathers.py``)."""
        self.gathers.gather_params()

    def buckets_reduced(self) -> int:
        """How many leading buckets have their shard gradient reduced in this backward."""
        return self.gathers.buckets_reduced()

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
