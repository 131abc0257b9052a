"""One parameter's piece of the partitioned training state (``ParamFragments``, held by
``ZeroPartitionedOptimizer`` over its ``ShardSet`` and stepper): where this rank's part of a
model parameter sits in the fp32 master slice, the optimizer state and the reduced gradient of
its bucket. ``deepspeed_cpp.utils.tensor_fragment`` (DeepSpeed's ``safe_get_full_fp32_param``
family) is built on these accessors; they never communicate.

A parameter's *fragment* on a rank is the run of its flattened elements that falls in the rank's
owned slice of the parameter's bucket: possibly empty where the parameter shares a bucket
(stages 1-2, ZeRO-3 persistent parameters); at ZeRO-3 a partitioned parameter is a bucket of its
own and its fragment is the whole shard, zero padding included, as DeepSpeed's local API gives it.
Concatenated over the ranks in rank order, the fragments are the flattened parameter (then the
padding).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ...utils.tensor_fragment import GradientNotAvailableError
from . import partition_parameters as pp
from .shard_set import ShardSet
from .steppers import InMemoryStepper

# The attribute linking a trained parameter to its fragments: a weak reference, so that a model
# outliving its engine does not keep the engine's state alive.
OWNER_ATTRIBUTE = "_ds_fragment_owner"


@dataclass(frozen=True)
class ParamFragment:
    """This rank's part of one parameter: elements ``[param_start, param_start + numel)`` of the
    flattened parameter (its padded extent for a ZeRO-3 partitioned one) are elements
    ``[master_start, master_start + numel)`` of the owned slice of bucket ``bucket``."""

    bucket: int
    master_start: int
    param_start: int
    numel: int
    whole_numel: int  # the parameter's elements, without padding
    partitioned: bool  # a ZeRO-3 partitioned parameter: the bucket is its shard
    replicated: bool  # stage 0: every rank holds every fragment whole


class ParamFragments:
    """The per-parameter accessors over a stage's shards (see the module docstring).
    ``loss_scaler``: the stage's (None without fp16 scaling). The stage sets
    ``gradients_ready`` while the shard gradients hold a boundary's final reduction, and
    ``local_grad`` (param -> this rank's locally accumulated gradient, or None) while inside
    ``engine.no_sync()``, where no reduced gradient exists yet."""

    def __init__(self, shards: ShardSet, stepper: InMemoryStepper, loss_scaler) -> None:
        self.shards = shards
        self.stepper = stepper
        self.loss_scaler = loss_scaler
        self.world_size, self.group = shards.world_size, shards.group
        self.gradients_ready = False
        self.local_grad = None
        self.position_of = {id(p): i for i, p in enumerate(shards.params)}

    def link(self) -> None:
        """Makes this the fragments ``fragment_owner`` finds for every parameter trained here
        (``deepspeed_cpp.utils.safe_get_full_fp32_param`` & co.)."""
        for param in self.shards.params:
            setattr(param, OWNER_ATTRIBUTE, weakref.ref(self))

    def unlink(self) -> None:
        for param in self.shards.params:
            owner = getattr(param, OWNER_ATTRIBUTE, None)
            if owner is not None and owner() is self:
                delattr(param, OWNER_ATTRIBUTE)

    def fragment_of(self, param: torch.nn.Parameter) -> ParamFragment:
        """Where this rank's part of ``param`` (one this optimizer trains) lives."""
        index = self.position_of[id(param)]
        plan = self.shards.plan
        bucket_index = plan.param_bucket[index]
        bucket = self.shards.buckets[bucket_index]
        offset = plan.param_offset[index]
        whole = param.ds_numel if pp.is_zero_param(param) else param.numel()
        partitioned = pp.is_partitioned(param) and len(bucket.params) == 1
        extent = bucket.size if partitioned else whole
        start = max(offset, bucket.owned_start)
        end = min(offset + extent, bucket.owned_start + bucket.owned_size)
        if end <= start:
            # None of it here. An empty run at 0: a parameter lying wholly after the owned slice
            # would otherwise start past the slice's end, which narrow() refuses even for 0
            # elements (ZeRO-2 MoE, rank 0: IndexError in safe_get_full_grad while rank 1 waited
            # in its all-reduce).
            start = end = bucket.owned_start
            offset = start
        return ParamFragment(
            bucket=bucket_index,
            master_start=start - bucket.owned_start,
            param_start=start - offset,
            numel=end - start,
            whole_numel=whole,
            partitioned=partitioned,
            replicated=self.shards.stage == 0,
        )

    def communication_device(self) -> torch.device:
        """Where the fragments of a collective over ``self.group`` are assembled."""
        return self.shards.shard_grads[0].device

    # --- fp32 master and optimizer state ----------------------------------------------------------
    @contextlib.contextmanager
    def fragment_values(
        self, param: torch.nn.Parameter, key: str | None, *, write: bool
    ) -> Iterator[torch.Tensor]:
        """This rank's fragment of ``param``'s fp32 master (``key`` None) or of its optimizer
        state ``key``: a 1-D view valid inside the block (with NVMe offload its sub-group is
        resident; ``write``: written back after). A delayed step still running is finished first
        (every rank must call then: it is collective)."""
        self.stepper.check_between_steps("reading or writing a parameter's fp32 master or state")
        fragment = self.fragment_of(param)
        members = self.shards.sub_group_of(fragment.bucket)
        with self.shards.home.resident(members, write_back=write), torch.no_grad():
            master = self.shards.masters[fragment.bucket]
            source = master if key is None else self._state_tensor(param, master, key)
            yield source.detach().narrow(0, fragment.master_start, fragment.numel)

    def _state_tensor(self, param, master: torch.Tensor, key: str) -> torch.Tensor:
        optimizer = self.stepper.optimizer_for(self.fragment_of(param).bucket)
        state = optimizer.state.get(master) or {}
        per_element = sorted(
            k for k, v in state.items() if torch.is_tensor(v) and v.shape == master.shape
        )
        if key in per_element:
            return state[key]
        name = getattr(param, "ds_name", None) or f"of shape {list(_shape_of(param))}"
        if not state:
            raise ValueError(
                f"optimizer state {key!r} of parameter {name}: the optimizer has no state yet "
                f"(it creates it at its first step)"
            )
        raise ValueError(
            f"{key!r} is not a per-element optimizer state of parameter {name}; "
            f"{type(optimizer).__name__} keeps {per_element}"
        )

    def write_model_copy(self, param: torch.nn.Parameter, whole: torch.Tensor | None) -> None:
        """Writes the fp32 master back into the parameter the model computes with, after a
        setter changed it: a ZeRO-3 shard from this rank's master; a replicated parameter from
        ``whole`` (its full new value, the same on every rank) or, without it, only this rank's
        fragment (the other ranks' copies follow at the next step's all-gather)."""
        fragment = self.fragment_of(param)
        with torch.no_grad():
            if fragment.partitioned:
                members = self.shards.sub_group_of(fragment.bucket)
                with self.shards.home.resident(members, write_back=False):
                    master = self.shards.masters[fragment.bucket].detach()
                    # fp32 shards on the device are their own masters: nothing to copy.
                    home = getattr(param, "ds_home", None)
                    if home is not None or param.ds_tensor.data_ptr() != master.data_ptr():
                        pp.store_shard(param, master)
            elif whole is not None:
                param.data.copy_(whole.reshape(param.data.shape))
            else:
                with self.fragment_values(param, None, write=False) as values:
                    flat = param.data.view(-1)
                    flat.narrow(0, fragment.param_start, fragment.numel).copy_(values)

    # --- reduced gradient -------------------------------------------------------------------------
    def fragment_grad(self, param: torch.nn.Parameter) -> torch.Tensor:
        """This rank's fragment of ``param``'s reduced gradient (averaged over the ranks,
        divided by the accumulation steps, not clipped; unscaled under fp16): a 1-D view of the
        shard gradient, to be multiplied by ``gradient_scale()`` before use when that is not 1."""
        if not self.gradients_ready:
            raise GradientNotAvailableError(
                "the reduced gradient of a parameter is available only between the backward of "
                "an accumulation boundary (the last micro-step) and engine.step()"
            )
        if self.stepper.steps_during_backward and self.stepper.backward_steps.stepped_count:
            raise GradientNotAvailableError(
                "zero_optimization.offload_optimizer.step_during_backward stepped optimizer "
                "sub-groups during this backward and reused their gradient buffers; set it to "
                "false to read reduced gradients between backward and engine.step()"
            )
        fragment = self.fragment_of(param)
        grad = self.shards.shard_grads[fragment.bucket]
        return grad.narrow(0, fragment.master_start, fragment.numel)

    def gradient_scale(self) -> float:
        """What the stored gradients are multiplied by to be the true ones (the fp16 loss scale
        is still in them until the step)."""
        return 1.0 if self.loss_scaler is None else 1.0 / float(self.loss_scaler.loss_scale)


def fragment_owner(param: torch.Tensor):
    """The ``ParamFragments`` of the live stage training ``param``, or None."""
    owner = getattr(param, OWNER_ATTRIBUTE, None)
    return None if owner is None else owner()


def _shape_of(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(param.ds_shape) if pp.is_zero_param(param) else tuple(param.shape)
