"""The partitioned optimizer's steps with offloaded masters (a mixin of
``ZeroPartitionedOptimizer``, which owns every attribute used here).

With offload, a bucket's fp32 master is not the device's shard: each step copies the reduced
shard gradients to the host home (``optimizer_homes.py``), steps the masters there one sub-group
at a time, and copies the updated values into the device tensors that hold this rank's part of
the parameters, from where the usual all-gather spreads them. With the delayed parameter update
the host step runs in the background (``delayed_update.py``) and is written at the next step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ....comm.collective_errors import named_collective
from .backward_steps import KEY as STEP_DURING_BACKWARD
from .backward_steps import BackwardSteps
from .delayed_update import DelayedUpdate
from .optimizer_offload import OptimizerOffload


class OffloadedStepping:
    """Offload's part of ``ZeroPartitionedOptimizer`` (see the module docstring)."""

    def _check_offload(self, offload: OptimizerOffload | None) -> DelayedUpdate | None:
        if offload is None:
            return None
        name = type(self.optimizer).__name__
        if self._device_optimizer is not None and not self._step_per_bucket:
            raise ValueError(
                f"zero_optimization.offload_optimizer.ratio < 1 steps the offloaded part one "
                f"sub-group at a time, which {name} cannot; use the config optimizer Adam/AdamW "
                f"(without torch_adam)"
            )
        if offload.device == "nvme" and not self._step_per_bucket:
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

    def _make_backward_steps(self, offload: OptimizerOffload | None) -> BackwardSteps | None:
        """The bookkeeping of ``step_during_backward``, after checking that nothing this
        optimizer does at the step needs every gradient first (the config refuses the same
        combinations by key; this covers optimizers built without one). Only on by default
        (None), it stays off where something excludes it."""
        if offload is None or offload.step_during_backward is False:
            return None
        conflicts = []
        if not self._step_per_bucket:
            conflicts.append(
                f"{type(self.optimizer).__name__}, which cannot step one sub-group at a time "
                f"(use the config's Adam/AdamW, DeepSpeedCPUAdam, DeepSpeedCPUAdagrad or "
                f"DeepSpeedCPULion)"
            )
        if self.gradient_clipping > 0.0:
            conflicts.append(f"gradient_clipping = {self.gradient_clipping}")
        if self.loss_scaler is not None:
            conflicts.append("fp16 loss scaling")
        if self._delayed is not None:
            conflicts.append("offload_optimizer.delayed_param_update")
        if self._device_optimizer is not None:
            conflicts.append(f"offload_optimizer.ratio = {offload.ratio}")
        if conflicts and offload.step_during_backward is None:
            return None
        if conflicts:
            raise ValueError(
                f"{STEP_DURING_BACKWARD} = true cannot be combined with {'; '.join(conflicts)}"
            )
        return BackwardSteps(self.home.sub_groups, self.optimizer)

    def _step_reduced_sub_groups(self) -> None:
        """During a boundary backward: hands every sub-group whose buckets are all reduced to
        the worker that steps them (``backward_steps.py``)."""
        early = self._backward_steps
        for group in early.ready(self.buckets_reduced()):
            members = self.home.sub_groups[group]
            # The step reuses the shard gradients' storage for the updated parameters (see
            # _staging_target): their norms for engine.step() are taken first, here, on the
            # thread (and with the thread count) that takes every other one.
            norms = torch._foreach_norm([self.shard_grads[index] for index in members])
            early.shard_grad_norms.update(zip(members, norms))
            early.submit(group, lambda m=members: self._step_sub_group(m, into_staging=True), norms)

    def _discard_early_steps(self) -> None:
        """Before a step with non-finite gradients is skipped: waits for the sub-groups handed
        to the ``step_during_backward`` worker and undoes those it stepped. A rank may have
        stepped sub-groups whose part of the gradient was finite (the worker declines every
        sub-group from the first one that is not finite on its rank; a NaN confined to other
        ranks' shards or to a later sub-group is seen only in the global norm). Those steps were
        tentative (``optimizer_homes.py``): their new state went to the other swap file (NVMe)
        or over a kept copy (host), and their updated parameters only to staging buffers, so
        discarding them leaves masters, optimizer state and parameters exactly as before the
        step, on every rank, with no collective (every rank sees the same global norm)."""
        early = self._backward_steps
        if early is None:
            return
        early.wait_for_worker()
        early.end_step()
        self.home.discard_tentative()

    def _shard_grad_norms(self) -> list[torch.Tensor]:
        """The norm of each shard gradient, those stepped during backward as taken then."""
        taken = self._backward_steps.shard_grad_norms if self._backward_steps is not None else {}
        if not taken:
            return torch._foreach_norm(self.shard_grads)
        rest = [grad for index, grad in enumerate(self.shard_grads) if index not in taken]
        computed = iter(torch._foreach_norm(rest) if rest else [])
        return [taken[i] if i in taken else next(computed) for i in range(len(self.shard_grads))]

    def _make_device_optimizer(self, factory, param_groups, on_device, optimizer):
        """The optimizer of the buckets a partial offload (``ratio`` < 1) leaves on the device:
        built from ``factory`` over their masters; its hyper-parameters follow ``optimizer``'s
        (schedulers drive that one) at every step."""
        if not on_device:
            return None
        if factory is None or isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(
                "zero_optimization.offload_optimizer.ratio < 1 needs the config's optimizer "
                "section (the part left on the device gets an optimizer of the same kind); got "
                "an optimizer object passed to initialize()"
            )
        if self._delayed_requested:
            raise ValueError(
                "zero_optimization.offload_optimizer.delayed_param_update needs ratio = 1 "
                "(the whole step on the host)"
            )
        return factory(self._master_param_groups(param_groups, list(on_device)))

    def _optimizer_for(self, bucket: int):
        """The optimizer that steps ``bucket``'s master."""
        if self._device_optimizer is not None and not self.home.offloaded(bucket):
            return self._device_optimizer
        return self.optimizer

    def _step_device_part(self) -> None:
        for device_group, group in zip(
            self._device_optimizer.param_groups, self.optimizer.param_groups
        ):
            device_group.update({k: v for k, v in group.items() if k != "params"})
        self._device_optimizer.step()

    def _step_offloaded(self) -> None:
        """Each sub-group in turn: brought in (NVMe), its shard gradients copied to the host, its
        masters stepped and written into the device parameters, which are gathered. With the
        delayed update the step runs in the background and is written at the next step."""
        if self._delayed is not None and self._delayed.next_step_is_delayed():
            self.apply_pending_update()
            self._copy_grads_to_host()
            snapshot = [dict(group) for group in self.optimizer.param_groups]
            self._delayed.launch(lambda: self._step_all_masters(snapshot))
            return
        if not self._step_per_bucket:  # the host home: every master resident at once
            self._copy_grads_to_host()
            self._step_all_masters(self.optimizer.param_groups)
            self._finish_gathers([self._gather_from_master(b) for b in range(len(self.buckets))])
            return
        early = self._backward_steps
        pending = []
        if early is not None:
            early.check_hyper_parameters(self.optimizer.param_groups)
        for group, members in enumerate(self.home.sub_groups):
            sources = early.take(group) if early is not None else None
            if sources is None:
                sources = self._step_sub_group(members, into_staging=False)
            pending.extend(self._launch_gather(self.buckets[i], source) for i, source in sources)
        if early is not None:
            early.end_step()
            # The global norm was finite: what was stepped during backward is this step's.
            # (The worker is idle: every early sub-group was taken above, in order.)
            self.home.commit_tentative()
        self._finish_gathers(pending)
        self.home.read_ahead_next_step()

    def _step_sub_group(self, members, *, into_staging: bool) -> list[tuple[int, torch.Tensor]]:
        """Brings in (NVMe) and steps one sub-group; returns, per bucket, the tensor holding this
        rank's updated part of its parameters, from which the all-gather starts. Normally that
        is the parameters' own storage where it can be; ``into_staging``: a new tensor, the
        parameters untouched (a step during backward, whose gathers wait for engine.step())."""
        sources = []
        # A step during backward is tentative: engine.step() commits or discards it once the
        # global gradient norm is known (``_discard_early_steps``).
        with self.home.resident(members, tentative=into_staging):
            for index in members:
                buffer = self.home.grad_buffer(index)
                if buffer is None:  # left on the device by a partial offload
                    self.masters[index].grad = self.shard_grads[index]
                    continue
                self.home.transfer.to_host(self.shard_grads[index], buffer)
                self.masters[index].grad = buffer
            self.home.transfer.synchronize()
            written = {}
            if self._optimizer_for(members[0]) is self.optimizer:
                written = self._copy_out_targets(members, into_staging)
                if written:
                    self.optimizer.step(fp16_param_groups=self._copy_out_groups(written))
                else:
                    self.optimizer.step()
            else:
                self._step_device_part()
            for index in members:
                self.masters[index].grad = None
                sources.append(
                    (index, self._gather_source(index, written.get(index), into_staging))
                )
        return sources  # the resident context synchronized the copies into them

    def _copy_out_targets(self, members, into_staging: bool = False) -> dict:
        """Where our CPU optimizers write the updated 16-bit parameters in the same pass as the
        step (DeepSpeed's ``fp16_param_groups``): this rank's part of each bf16/fp16 bucket."""
        if not hasattr(self.optimizer, "step_groups"):
            return {}
        return {
            index: self._staging_target(index)
            if into_staging
            else self._owned_device_target(self.buckets[index])
            for index in members
            if self.buckets[index].gather_dtype in (torch.bfloat16, torch.float16)
        }

    def _copy_out_groups(self, written: dict) -> list[list]:
        if getattr(self, "_master_index", None) is None:
            self._master_index = {id(master): i for i, master in enumerate(self.masters)}
        # .get: the optimizer may also step other ZeRO instances' masters (the expert sets of
        # ``moe_stage.py`` share one); those get no copy-out here.
        return [
            [written.get(self._master_index.get(id(p))) for p in group["params"]]
            for group in self.optimizer.param_groups
        ]

    # --- driven by a stage composed of several sets (``moe_stage.py``) ---------------------------
    def use_optimizer(self, optimizer, offload: OptimizerOffload | None) -> None:
        """Steps the masters with ``optimizer`` from now on: one made over several sets' masters
        by the stage that composes them. What was decided with the optimizer this set was built
        with (stepping bucket by bucket, the offload checks, the home's state slots) is decided
        again with it."""
        self.optimizer = optimizer
        self._step_per_bucket = bool(getattr(optimizer, "steps_tensors_independently", False))
        self._check_offload(offload)
        self.home.attach(self.masters, optimizer)

    @property
    def steps_per_bucket(self) -> bool:
        """Whether the optimizer steps each master on its own (ours), so that sub-groups, and
        sets, can be stepped one after another with it."""
        return self._step_per_bucket

    def step_on_host(self) -> None:
        """The offloaded step of this set's (unscaled, clipped) shard gradients, sub-group by
        sub-group, and the gathers of its parameters."""
        self._step_offloaded()

    def hand_host_grads_to_masters(self) -> None:
        """Copies the shard gradients to the host home and makes them the masters' ``grad``, for
        one optimizer step over several sets' masters (all resident: the host home); then
        ``gather_params_from_host``."""
        self._copy_grads_to_host()
        for index, master in enumerate(self.masters):
            master.grad = self.home.grad_buffer(index)

    def drop_master_grads(self) -> None:
        """Undoes ``hand_host_grads_to_masters`` once the step ran (or failed)."""
        for master in self.masters:
            master.grad = None

    def gather_params_from_host(self) -> None:
        """Writes every host master into every rank's parameters (after that step)."""
        self._finish_gathers([self._gather_from_master(b) for b in range(len(self.buckets))])

    def _copy_grads_to_host(self) -> None:
        """Every shard gradient into its host buffer (the host home: all resident)."""
        for index, grad in enumerate(self.shard_grads):
            self.home.transfer.to_host(grad, self.home.grad_buffer(index))
        self.home.transfer.synchronize()

    def _step_all_masters(self, groups: list[dict]) -> None:
        for index, master in enumerate(self.masters):
            master.grad = self.home.grad_buffer(index)
        try:
            if groups is self.optimizer.param_groups:
                self.optimizer.step()
            else:
                self.optimizer.step_groups(groups)
        finally:
            for master in self.masters:
                master.grad = None

    def apply_pending_update(self) -> None:
        """Finishes a delayed step still running and writes its result into the parameters."""
        if self._delayed is not None and self._finish_delayed_on_every_rank():
            with torch.no_grad():
                self._finish_gathers(
                    [self._gather_from_master(b) for b in range(len(self.buckets))]
                )

    def discard_pending_update(self) -> None:
        """Waits for a delayed step still running and drops its result (a load follows)."""
        if self._delayed is not None:
            self._finish_delayed_on_every_rank()

    def _finish_delayed_on_every_rank(self) -> bool:
        """Joins the background step; a failure on any rank raises on every rank (the others
        would otherwise wait in the gathers that follow)."""
        if not self._delayed.pending:
            return False
        try:
            self._delayed.finish()
            failed = None
        except RuntimeError as error:
            failed = error
        flag = torch.tensor([0.0 if failed is None else 1.0], device=self.shard_grads[0].device)
        if self.world_size > 1:
            with named_collective("all_reduce of the delayed (offloaded) optimizer step's outcome"):
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if failed is not None:
            raise failed
        if flag.item() > 0:
            raise RuntimeError("the delayed optimizer step failed on another rank")
        return True

    def _gather_source(self, index: int, written, into_staging: bool) -> torch.Tensor:
        """Inside the sub-group's ``resident``: the tensor the all-gather of bucket ``index``
        starts from (``written``: its updated values already copied out there)."""
        if written is not None:
            return written
        master = self.masters[index]
        if not self.home.offloaded(index):
            return master
        bucket = self.buckets[index]
        target = self._staging_target(index) if into_staging else self._owned_device_target(bucket)
        self.home.transfer.to_device(master.detach(), target)
        return target

    def _staging_target(self, index: int) -> torch.Tensor:
        """Where a step during backward leaves this rank's updated part of bucket ``index``, in
        the parameters' dtype, apart from them: the front of the bucket's float32 shard
        gradient. Its values were copied to the host (and its norm taken) before the step; it
        is overwritten by the next reduction, after engine.step() gathered from it. Its own
        tensor would cost 2 or 4 bytes per owned element until engine.step()."""
        bucket, grad = self.buckets[index], self.shard_grads[index]
        size = bucket.owned_size * bucket.gather_dtype.itemsize
        return grad.view(torch.uint8)[:size].view(bucket.gather_dtype)

    def _gather_from_master(self, index: int, written: torch.Tensor | None = None):
        """Starts writing master ``index`` into every rank's parameters (``written``: its
        values already copied out, in the parameters' dtype, to that tensor)."""
        source = self._gather_source(index, written, into_staging=False)
        return self._launch_gather(self.buckets[index], source)

    def _owned_device_target(self, bucket) -> torch.Tensor:
        """The device tensor that holds this rank's part of ``bucket``'s parameters."""
        if self._params_still_view_flat(bucket):
            return bucket.flat.narrow(0, bucket.owned_start, bucket.owned_size)
        device = self.params[0].device
        return torch.empty(bucket.owned_size, dtype=bucket.gather_dtype, device=device)
