"""How a ZeRO stage steps its master shards: the stepper it holds, chosen once when the stage is
built (``shard_set_builder.py``: offloaded where ``offload_optimizer`` is set, else in memory).
``InMemoryStepper`` is also the interface every stepper has.

- ``InMemoryStepper``: the masters live next to their shard gradients (no offload); the
  optimizer steps them and the updated slices are all-gathered into every rank's parameters;
- ``OffloadedStepper`` (``offload/stepping.py``): the masters and optimizer state live on the host
  or NVMe; each step copies the shard gradients there, steps one sub-group at a time, and
  gathers from there; also the delayed parameter update (a background step written at the next
  one) and ``step_during_backward`` (sub-groups stepped while backward goes on).

A stepper operates on the stage's ``ShardSet`` (plain state) and asks the stage's
``ParamGathers`` to write updated values into the parameters; it reads nothing else of the
stage. The stage calls it through the public methods below; of its fields others read only
``optimizer`` (the torch optimizer over the masters, which ``use_optimizer`` replaces),
``step_per_bucket`` (whether it steps each master on its own) and
``backward_steps`` (None unless sub-groups may step during backward).
"""

from __future__ import annotations

import torch

from .chunked_step import can_step_in_chunks, step_in_chunks
from .shard_set import ParamGathers, ShardSet


class InMemoryStepper:
    """Steps masters held in memory (see the module docstring); the base of the offloaded
    stepper, whose extra duties are no-ops here."""

    # Set by the offloaded stepper where sub-groups may be stepped during backward.
    backward_steps = None
    device_optimizer = None  # the optimizer of a partial offload's device part

    def __init__(self, shards: ShardSet, gathers: ParamGathers, optimizer) -> None:
        self.shards = shards
        self.gathers = gathers
        self.optimizer = optimizer
        # Optimizers that step every tensor on its own (ours) can step bucket by bucket.
        self.step_per_bucket = _steps_tensors_independently(optimizer)

    def use_optimizer(self, optimizer, offload) -> None:
        """Steps the masters with ``optimizer`` from now on (one made over several sets' masters
        by the stage that composes them, ``moe_stage.py``)."""
        self.optimizer = optimizer
        self.step_per_bucket = _steps_tensors_independently(optimizer)

    @property
    def steps_during_backward(self) -> bool:
        """Whether sub-groups may be stepped inside backward (``offload/backward_steps.py``)."""
        return self.backward_steps is not None

    def optimizer_for(self, bucket: int):
        """The optimizer that steps ``bucket``'s master."""
        return self.optimizer

    def optimizers(self) -> list:
        """Every optimizer stepping this set's masters."""
        return [self.optimizer]

    def state_bytes(self) -> int:
        """Bytes of optimizer state and fp32 master shards this rank holds in memory (with
        offload: the host bytes of masters, state and gradient buffers, or NVMe's swap buffers)."""
        home, masters = self.shards.home, self.shards.masters
        device_optimizer = self.device_optimizer
        if home.kind != "none" and device_optimizer is None:
            return home.host_bytes()
        in_memory = [m for i, m in enumerate(masters) if not home.offloaded(i)]
        total = sum(m.numel() * m.element_size() for m in in_memory)
        if home.kind != "none":
            total += home.host_bytes()
        optimizer = self.optimizer if device_optimizer is None else device_optimizer
        # list(): a delayed step may be adding state in its thread; copying a dict's values is
        # one call under the GIL, iterating it is not.
        for state in list(optimizer.state.values()):
            for value in list(state.values()):
                if torch.is_tensor(value) and value.dim() > 0:
                    total += value.numel() * value.element_size()
        return total

    # --- during backward (only the offloaded stepper acts) -------------------------------------
    def begin_backward(self, reducing_boundary: bool) -> None:
        pass

    def after_reduction(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    # --- the step -----------------------------------------------------------------------------
    def shard_grad_norms(self) -> list[torch.Tensor]:
        """The norm of each shard gradient (float32, as torch's clip_grad_norm_)."""
        return torch._foreach_norm(self.shards.shard_grads)

    def discard_early_steps(self) -> None:
        """Undoes what was stepped during backward, before a skipped step."""

    def step_and_gather(self) -> None:
        """Steps the master shards and writes the updated values into every rank's parameters.

        Our CPU optimizers step bucket by bucket, each bucket's all-gather starting as soon as it
        is updated, so that the gather of one overlaps the update of the next. They update each
        tensor on its own (state and step count per tensor) and skip tensors without a gradient,
        so stepping the buckets one at a time equals one step over all. Other optimizers (the
        user's may keep per-group counters) step once, then everything is gathered.
        """
        shards, gathers = self.shards, self.gathers
        shards.link_master_grads()
        per_bucket = self.step_per_bucket and shards.stage != 0 and len(shards.masters) > 1
        # One call over every bucket (stage 3 without persistent buckets) steps the gradients
        # just linked: no per-bucket unlinking and relinking (four per parameter at stage 3).
        if not per_bucket or len(gathers.bucket_step_calls()) == 1:
            if can_step_in_chunks(self.optimizer):  # torch's Adam: cache-sized pieces
                step_in_chunks(self.optimizer)
            else:
                self.optimizer.step()
            pending = [gathers.launch_gather(b, m) for b, m in zip(shards.buckets, shards.masters)]
        else:
            pending = []
            for master in shards.masters:
                master.grad = None
            try:
                for call in gathers.bucket_step_calls():
                    for index in call:
                        shards.masters[index].grad = shards.shard_grads[index]
                    self.optimizer.step()
                    for index in call:
                        shards.masters[index].grad = None
                        pending.append(
                            gathers.launch_gather(shards.buckets[index], shards.masters[index])
                        )
            finally:
                for master, grad in zip(shards.masters, shards.shard_grads):
                    master.grad = grad
        gathers.finish_gathers(pending)

    def gather_from_master(self, index: int):
        """Starts writing master ``index`` into every rank's parameters; a pending gather."""
        return self.gathers.launch_gather(self.shards.buckets[index], self.shards.masters[index])

    def write_params_from_masters(self) -> None:
        """Writes the fp32 master slices into every rank's parameters (after a load)."""
        self.apply_pending_update()
        home = self.shards.home
        pending = []
        with torch.no_grad():
            for members in home.sub_groups:
                with home.resident(members, write_back=False):
                    pending.extend(self.gather_from_master(b) for b in members)
            self.gathers.finish_gathers(pending)

    # --- between steps --------------------------------------------------------------------------
    def apply_pending_update(self) -> None:
        """Writes a delayed step's result into the parameters (none in memory)."""

    def discard_pending_update(self) -> None:
        """Drops a delayed step's result (none in memory)."""

    def check_between_steps(self, what: str) -> None:
        """Raises where ``what`` cannot happen now (between a backward that stepped and
        ``engine.step()``); finishes a delayed step first."""

    def resume_after(self, states: list[dict]) -> None:
        """After loading a checkpoint's optimizer state (``states``, per bucket)."""

    def close(self) -> None:
        """Stops what the stepper runs in the background."""


def _steps_tensors_independently(optimizer) -> bool:
    return bool(getattr(optimizer, "steps_tensors_independently", False))
