"""The stepper of a stage whose masters are offloaded (``steppers.py`` says what a stepper is).

With offload, a bucket's fp32 master is not the device's shard: each step copies the reduced
shard gradients to the host home (``optimizer_homes.py``), steps the masters there one sub-group
at a time, and copies the updated values into the device tensors that hold this rank's part of
the parameters, from where the usual all-gather spreads them. With the delayed parameter update
the host step runs in the background (``delayed_update.py``) and is written at the next step.
With ``step_during_backward`` sub-groups are stepped while backward goes on
(``backward_steps.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ....comm.collective_errors import named_collective
from ..shard_set import ParamGathers, ShardSet
from ..steppers import InMemoryStepper
from .backward_steps import KEY as STEP_DURING_BACKWARD
from .backward_steps import BackwardSteps
from .delayed_update import DelayedUpdate
from .optimizer_offload import OptimizerOffload


def make_device_optimizer(
    factory, on_device, optimizer, delayed_requested: bool, device_groups: list[dict]
):
    """The optimizer of the buckets a partial offload (``ratio`` < 1) leaves on the device
    (``on_device``): built from ``factory`` over their masters' param groups
    (``device_groups``); its hyper-parameters follow ``optimizer``'s (schedulers drive that
    one) at every step."""
    if not on_device:
        return None
    if factory is None or isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            "zero_optimization.offload_optimizer.ratio < 1 needs the config's optimizer "
            "section (the part left on the device gets an optimizer of the same kind); got "
            "an optimizer object passed to initialize()"
        )
    if delayed_requested:
        raise ValueError(
            "zero_optimization.offload_optimizer.delayed_param_update needs ratio = 1 "
            "(the whole step on the host)"
        )
    return factory(device_groups)


class OffloadedStepper(InMemoryStepper):
    """Steps offloaded masters (see the module docstring)."""

    def __init__(
        self,
        shards: ShardSet,
        gathers: ParamGathers,
        optimizer,
        offload: OptimizerOffload,
        *,
        device_optimizer=None,
        gradient_clipping: float = 0.0,
        loss_scaled: bool = False,
    ) -> None:
        super().__init__(shards, gathers, optimizer)
        self.device_optimizer = device_optimizer
        self.delayed = self._check_offload(offload)
        self.backward_steps = self._make_backward_steps(offload, gradient_clipping, loss_scaled)
        self._master_index: dict[int, int] | None = None

    def _check_offload(self, offload: OptimizerOffload | None) -> DelayedUpdate | None:
        if offload is None:
            return None
        name = type(self.optimizer).__name__
        if self.device_optimizer is not None and not self.step_per_bucket:
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio < 1 steps the offloaded part one "
                f"sub-group at a time, which {name} cannot; use the config optimizer Adam/AdamW "
                f"(without torch_adam)"
            )
        if offload.device == "nvme" and not self.step_per_bucket:
            raise ValueError(
                f"offload_optimizer.device nvme steps one sub-group at a time, which {name} "
                f"cannot (it may keep per-group state); use the config optimizer Adam/AdamW or "
                f"DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion"
            )
        if offload.delayed_update_after is None:
            return None
        if offload.device != "cpu" or not hasattr(self.optimizer, "step_groups"):
            raise ValueError(
                f"offload_optimizer.delayed_param_update needs offload_optimizer.device cpu and "
                f"one of deepspeed_cpp's CPU optimizers (the config's Adam/AdamW, "
                f"DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion); got device "
                f"{offload.device!r} and {name}"
            )
        return DelayedUpdate(offload.delayed_update_after)

    def _make_backward_steps(
        self, offload: OptimizerOffload, gradient_clipping: float, loss_scaled: bool
    ) -> BackwardSteps | None:
        """The bookkeeping of ``step_during_backward``, after checking that nothing this
        optimizer does at the step needs every gradient first (the config refuses the same
        combinations by key; this covers optimizers built without one). Only on by default
        (None), it stays off where something excludes it."""
        if offload.step_during_backward is False:
            return None
        conflicts = []
        if not self.step_per_bucket:
            conflicts.append(
                f"{type(self.optimizer).__name__}, which cannot step one sub-group at a time "
                f"(use the config's Adam/AdamW, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad or "
                f"DeepSpeedCPULion)"
            )
        if gradient_clipping > 0.0:
            conflicts.append(f"gradient_clipping = {gradient_clipping}")
        if loss_scaled:
            conflicts.append("fp16 loss scaling")
        if self.delayed is not None:
            conflicts.append("offload_optimizer.delayed_param_update")
        if self.device_optimizer is not None:
            conflicts.append(f"offload_optimizer.ratio = {offload.ratio}")
        if conflicts and offload.step_during_backward is None:
            return None
        if conflicts:
            raise ValueError(
                f"{STEP_DURING_BACKWARD} = true cannot be combined with {'; '.join(conflicts)}"
            )
        return BackwardSteps(self.shards.home.sub_groups, self.optimizer)

    def use_optimizer(self, optimizer, offload: OptimizerOffload | None) -> None:
        """What was decided with the optimizer this set was built with (stepping bucket by
        bucket, the offload checks) is decided again with ``optimizer``."""
        super().use_optimizer(optimizer, offload)
        self._check_offload(offload)

    def optimizer_for(self, bucket: int):
        if self.device_optimizer is not None and not self.shards.home.offloaded(bucket):
            return self.device_optimizer
        return self.optimizer

    def optimizers(self) -> list:
        return [self.optimizer] + ([self.device_optimizer] if self.device_optimizer else [])

    # --- during backward ------------------------------------------------------------------------
    def begin_backward(self, reducing_boundary: bool) -> None:
        if self.backward_steps is not None:
            self.backward_steps.begin_backward(reducing_boundary)

    def end_backward(self) -> None:
        if self.backward_steps is not None:
            self.backward_steps.end_backward()  # the rest is stepped at the step

    def after_reduction(self) -> None:
        """During a boundary backward: hands every sub-group whose buckets are all reduced to
        the worker that steps them (``backward_steps.py``)."""
        early = self.backward_steps
        if early is None or not early.active:
            return
        shard_grads = self.shards.shard_grads
        for group in early.ready(self.gathers.buckets_reduced()):
            members = self.shards.home.sub_groups[group]
            # The step reuses the shard gradients' storage for the updated parameters (see
            # _staging_target): their norms for engine.step() are taken first, here, on the
            # thread (and with the thread count) that takes every other one.
            norms = torch._foreach_norm([shard_grads[index] for index in members])
            early.shard_grad_norms.update(zip(members, norms))
            early.submit(group, lambda m=members: self._step_sub_group(m, into_staging=True), norms)

    # --- the step -------------------------------------------------------------------------------
    def discard_early_steps(self) -> None:
        """Before a step with non-finite gradients is skipped: waits for the sub-groups handed
        to the ``step_during_backward`` worker and undoes those it stepped. A rank may have
        stepped sub-groups whose part of the gradient was finite (the worker declines every
        sub-group from the first one that is not finite on its rank; a NaN confined to other
        ranks' shards or to a later sub-group is seen only in the global norm). Those steps were
        tentative (``optimizer_homes.py``): their new state went to the other swap file (NVMe)
        or over a kept copy (host), and their updated parameters only to staging buffers, so
        discarding them leaves masters, optimizer state and parameters exactly as before the
        step, on every rank, with no collective (every rank sees the same global norm)."""
        early = self.backward_steps
        if early is None:
            return
        early.wait_for_worker()
        early.end_step()
        self.shards.home.discard_tentative()

    def shard_grad_norms(self) -> list[torch.Tensor]:
        """The norm of each shard gradient, those stepped during backward as taken then."""
        taken = self.backward_steps.shard_grad_norms if self.backward_steps is not None else {}
        if not taken:
            return super().shard_grad_norms()
        shard_grads = self.shards.shard_grads
        rest = [grad for index, grad in enumerate(shard_grads) if index not in taken]
        computed = iter(torch._foreach_norm(rest) if rest else [])
        return [taken[i] if i in taken else next(computed) for i in range(len(shard_grads))]

    def step_and_gather(self) -> None:
        if self.shards.home.kind == "none":  # an offload that left every bucket on the device
            super().step_and_gather()
        else:
            self.step_on_host()

    def _step_device_part(self) -> None:
        for device_group, group in zip(
            self.device_optimizer.param_groups, self.optimizer.param_groups
        ):
            device_group.update({k: v for k, v in group.items() if k != "params"})
        self.device_optimizer.step()

    def step_on_host(self) -> None:
        """Each sub-group in turn: brought in (NVMe), its shard gradients copied to the host, its
        masters stepped and written into the device parameters, which are gathered. With the
        delayed update the step runs in the background and is written at the next step."""
        home, buckets = self.shards.home, self.shards.buckets
        if self.delayed is not None and self.delayed.next_step_is_delayed():
            self.apply_pending_update()
            self._copy_grads_to_host()
            snapshot = [dict(group) for group in self.optimizer.param_groups]
            self.delayed.launch(lambda: self._step_all_masters(snapshot))
            return
        if not self.step_per_bucket:  # the host home: every master resident at once
            self._copy_grads_to_host()
            self._step_all_masters(self.optimizer.param_groups)
            self.gather_params_from_host()
            return
        early = self.backward_steps
        pending = []
        if early is not None:
            early.check_hyper_parameters(self.optimizer.param_groups)
        for group, members in enumerate(home.sub_groups):
            sources = early.take(group) if early is not None else None
            if sources is None:
                sources = self._step_sub_group(members, into_staging=False)
            pending.extend(self.gathers.launch_gather(buckets[i], source) for i, source in sources)
        if early is not None:
            early.end_step()
            # The global norm was finite: what was stepped during backward is this step's.
            # (The worker is idle: every early sub-group was taken above, in order.)
            home.commit_tentative()
        self.gathers.finish_gathers(pending)
        home.read_ahead_next_step()

    def _step_sub_group(self, members, *, into_staging: bool) -> list[tuple[int, torch.Tensor]]:
        """Brings in (NVMe) and steps one sub-group; returns, per bucket, the tensor holding this
        rank's updated part of its parameters, from which the all-gather starts. Normally that
        is the parameters' own storage where it can be; ``into_staging``: a new tensor, the
        parameters untouched (a step during backward, whose gathers wait for engine.step())."""
        home, masters, shard_grads = self.shards.home, self.shards.masters, self.shards.shard_grads
        sources = []
        # A step during backward is tentative: engine.step() commits or discards it once the
        # global gradient norm is known (``discard_early_steps``).
        with home.resident(members, tentative=into_staging):
            for index in members:
                buffer = home.grad_buffer(index)
                if buffer is None:  # left on the device by a partial offload
                    masters[index].grad = shard_grads[index]
                    continue
                home.transfer.to_host(shard_grads[index], buffer)
                masters[index].grad = buffer
            home.transfer.synchronize()
            written = {}
            if self.optimizer_for(members[0]) is self.optimizer:
                written = self._copy_out_targets(members, into_staging)
                if written:
                    self.optimizer.step(fp16_param_groups=self._copy_out_groups(written))
                else:
                    self.optimizer.step()
            else:
                self._step_device_part()
            for index in members:
                masters[index].grad = None
                sources.append(
                    (index, self._gather_source(index, written.get(index), into_staging))
                )
        return sources  # the resident context synchronized the copies into them

    def _copy_out_targets(self, members, into_staging: bool = False) -> dict:
        """Where our CPU optimizers write the updated 16-bit parameters in the same pass as the
        step (DeepSpeed's ``fp16_param_groups``): this rank's part of each bf16/fp16 bucket."""
        if not hasattr(self.optimizer, "step_groups"):
            return {}
        buckets = self.shards.buckets
        return {
            index: self._staging_target(index)
            if into_staging
            else self.gathers.owned_device_target(buckets[index])
            for index in members
            if buckets[index].gather_dtype in (torch.bfloat16, torch.float16)
        }

    def _copy_out_groups(self, written: dict) -> list[list]:
        if self._master_index is None:
            self._master_index = {id(master): i for i, master in enumerate(self.shards.masters)}
        # .get: the optimizer may also step other ZeRO instances' masters (the expert sets of
        # ``moe_stage.py`` share one); those get no copy-out here.
        return [
            [written.get(self._master_index.get(id(p))) for p in group["params"]]
            for group in self.optimizer.param_groups
        ]

    # --- driven by a stage composed of several sets (``moe_stage.py``) ---------------------------
    def hand_host_grads_to_masters(self) -> None:
        """Copies the shard gradients to the host home and makes them the masters' ``grad``, for
        one optimizer step over several sets' masters (all resident: the host home); then
        ``gather_params_from_host``."""
        self._copy_grads_to_host()
        for index, master in enumerate(self.shards.masters):
            master.grad = self.shards.home.grad_buffer(index)

    def drop_master_grads(self) -> None:
        """Undoes ``hand_host_grads_to_masters`` once the step ran (or failed)."""
        for master in self.shards.masters:
            master.grad = None

    def gather_params_from_host(self) -> None:
        """Writes every host master into every rank's parameters (after that step)."""
        self.gathers.finish_gathers(
            [self.gather_from_master(b) for b in range(len(self.shards.buckets))]
        )

    def _copy_grads_to_host(self) -> None:
        """Every shard gradient into its host buffer (the host home: all resident)."""
        home = self.shards.home
        for index, grad in enumerate(self.shards.shard_grads):
            home.transfer.to_host(grad, home.grad_buffer(index))
        home.transfer.synchronize()

    def _step_all_masters(self, groups: list[dict]) -> None:
        masters = self.shards.masters
        for index, master in enumerate(masters):
            master.grad = self.shards.home.grad_buffer(index)
        try:
            if groups is self.optimizer.param_groups:
                self.optimizer.step()
            else:
                self.optimizer.step_groups(groups)
        finally:
            for master in masters:
                master.grad = None

    # --- between steps --------------------------------------------------------------------------
    def apply_pending_update(self) -> None:
        """Finishes a delayed step still running and writes its result into the parameters."""
        if self.delayed is not None and self._finish_delayed_on_every_rank():
            with torch.no_grad():
                self.gather_params_from_host()

    def discard_pending_update(self) -> None:
        """Waits for a delayed step still running and drops its result (a load follows)."""
        if self.delayed is not None:
            self._finish_delayed_on_every_rank()

    def check_between_steps(self, what: str) -> None:
        if self.backward_steps is not None:
            self.backward_steps.check_between_steps(what)
        self.apply_pending_update()

    def resume_after(self, states: list[dict]) -> None:
        if self.delayed is not None:
            # The delayed update's warm-up goes on where the checkpoint's steps left it.
            self.delayed.steps_seen = _steps_taken(states)

    def close(self) -> None:
        if self.backward_steps is not None:
            self.backward_steps.close()

    def _finish_delayed_on_every_rank(self) -> bool:
        """Joins the background step; a failure on any rank raises on every rank (the others
        would otherwise wait in the gathers that follow)."""
        if not self.delayed.pending:
            return False
        try:
            self.delayed.finish()
            failed = None
        except RuntimeError as error:
            failed = error
        shards = self.shards
        flag = torch.tensor([0.0 if failed is None else 1.0], device=shards.shard_grads[0].device)
        if shards.world_size > 1:
            with named_collective("all_reduce of the delayed (offloaded) optimizer step's outcome"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=shards.group)
        if failed is not None:
            raise failed
        if flag.item() > 0:
            raise RuntimeError("the delayed optimizer step failed on another rank")
        return True

    # --- where updated values go ----------------------------------------------------------------
    def _gather_source(self, index: int, written, into_staging: bool) -> torch.Tensor:
        """Inside the sub-group's ``resident``: the tensor the all-gather of bucket ``index``
        starts from (``written``: its updated values already copied out there)."""
        if written is not None:
            return written
        master = self.shards.masters[index]
        if not self.shards.home.offloaded(index):
            return master
        bucket = self.shards.buckets[index]
        target = (
            self._staging_target(index)
            if into_staging
            else self.gathers.owned_device_target(bucket)
        )
        self.shards.home.transfer.to_device(master.detach(), target)
        return target

    def _staging_target(self, index: int) -> torch.Tensor:
        """Where a step during backward leaves this rank's updated part of bucket ``index``, in
        the parameters' dtype, apart from them: the front of the bucket's float32 shard
        gradient. Its values were copied to the host (and its norm taken) before the step; it
        is overwritten by the next reduction, after engine.step() gathered from it. Its own
        tensor would cost 2 or 4 bytes per owned element until engine.step()."""
        bucket, grad = self.shards.buckets[index], self.shards.shard_grads[index]
        size = bucket.owned_size * bucket.gather_dtype.itemsize
        return grad.view(torch.uint8)[:size].view(bucket.gather_dtype)

    def gather_from_master(self, index: int):
        source = self._gather_source(index, None, into_staging=False)
        return self.gathers.launch_gather(self.shards.buckets[index], source)


def _steps_taken(states: list[dict]) -> int:
    """The optimizer steps a checkpoint's state records (its per-tensor ``step`` counters)."""
    counts = [int(s["step"]) for s in states if s and "step" in s]
    return max(counts, default=0)
