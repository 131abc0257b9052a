"""Building a ZeRO stage's moving parts, in one place: the ``ShardSet`` (the bucket plan, made
once; the buckets; the home; the fp32 masters and shard gradients), the C++ reducer (handed the
plan as data), the ``ParamGathers`` and the stepper, composed into a
``ZeroPartitionedOptimizer`` by ``build_zero_stage``.

What differs between the stages is a layout strategy (``BucketLayout``), not the construction:

- ``FlatBuckets`` (stages 0-2, here): parameters packed into flat buckets in reverse
  registration order per param group, each parameter a view of its bucket's flat tensor, one
  reduction per bucket;
- ``PartitionedBuckets`` (stage 3, ``partitioned_buckets.py``): every partitioned parameter a
  bucket of its own whose shard is its ``ds_tensor``, reduced one fetch unit at a time.

``runtime/zero/build.py`` builds each stage through ``build_zero_stage``; the expert-parallel
stage (``moe_stage.py``) builds one set per expert group through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ...comm.reducer_tap import logged_if_enabled
from ...ops.zero import BucketPlan, flatten_into, make_gradient_reducer, plan_buckets
from .in_place_grads import InPlaceGradients, grads_can_stay_in_place
from .offload.optimizer_offload import OptimizerOffload
from .offload.stepping import OffloadedStepper, make_device_optimizer
from .param_gathers import MasterGathers, owned_slice_of_flat_params
from .partitioned_optimizer import StageParts, ZeroPartitionedOptimizer
from .shard_set import Bucket, ParamGathers, ShardSet
from .stage_setup import OptimizerOrFactory, optimizer_over_masters, trained_param_groups
from .steppers import InMemoryStepper


@dataclass
class Reduction:
    """How the C++ reducer reduces a set's buckets: ``shard_grads`` (one per bucket, where a
    stepper reads it) are ``destinations`` themselves or views into them (one per reduction the
    reducer's ``plan`` describes); ``rank_major``: ``make_gradient_reducer``'s, None for the
    plain layout; ``buckets_final_after[k]``: the leading buckets whose shard gradient is final
    once the first ``k`` reductions are harvested."""

    shard_grads: list[torch.Tensor]
    plan: BucketPlan
    destinations: list[torch.Tensor]
    rank_major: list[int] | None
    buckets_final_after: list[int]


class BucketLayout(Protocol):
    """What a stage kind decides while its ``ShardSet`` is built (see the module docstring)."""

    stages: tuple[int, ...]

    def plan(
        self, param_groups: list[dict], *, capacity: int, world_size: int
    ) -> tuple[list[torch.nn.Parameter], BucketPlan]:
        """The trainable parameters in plan order and their bucket plan."""

    def prepare(self, bucket: Bucket) -> None:
        """Lays ``bucket``'s parameters out (flat views) before masters are read from them."""

    def master_slice(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        """This rank's fp32 values of ``bucket``, which its master starts from."""

    def reduction(
        self, buckets: list[Bucket], plan: BucketPlan, *, capacity: int, device
    ) -> Reduction:
        """The shard gradients and the reducer's plan over them (``capacity``: the
        ``reduce_bucket_size`` the plan was made with)."""

    def gathers(self, shards: ShardSet, reducer, buckets_final_after: list[int]) -> ParamGathers:
        """How the stepper writes updated masters into the parameters."""


class FlatBuckets:
    """Stages 0-2: the trainable parameters in the order their gradients usually become ready
    (reverse registration order) per param group, so that a bucket never mixes groups, packed
    into flat buckets whose flat tensor the parameters view (where they share a dtype and a
    device); one reduction per bucket."""

    stages = (0, 1, 2)

    def plan(self, param_groups, *, capacity, world_size):
        ordered: list[tuple[int, torch.nn.Parameter]] = []
        for group_index, param_group in enumerate(param_groups):
            trainable = [p for p in param_group["params"] if p.requires_grad]
            ordered.extend((group_index, p) for p in reversed(trainable))
        if not ordered:
            raise ValueError("the optimizer has no trainable parameters (requires_grad=True)")
        plan = plan_buckets(
            [p.numel() for _, p in ordered],
            [g for g, _ in ordered],
            capacity=capacity,
            world_size=world_size,
        )
        return [p for _, p in ordered], plan

    def prepare(self, bucket: Bucket) -> None:
        view_params_in_flat(bucket)

    def master_slice(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        return flat_master_slice(bucket, device)

    def reduction(self, buckets, plan, *, capacity, device) -> Reduction:
        grads = [torch.zeros(b.owned_size, dtype=torch.float32, device=device) for b in buckets]
        return Reduction(
            shard_grads=grads,
            plan=plan,
            destinations=grads,
            rank_major=None,
            buckets_final_after=list(range(len(buckets) + 1)),
        )

    def gathers(self, shards, reducer, buckets_final_after) -> ParamGathers:
        return MasterGathers(shards, reducer, buckets_final_after)


def view_params_in_flat(bucket: Bucket) -> None:
    """Makes ``bucket``'s parameters views of one flat tensor in their dtype (where they share
    one dtype and device), so that the all-gather after a step writes them in place."""
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


def flat_master_slice(bucket: Bucket, device: torch.device) -> torch.Tensor:
    if bucket.flat is not None and bucket.flat.dtype == torch.float32:
        # fp32 parameters are their own master weights: the master slice is this rank's part
        # of the flat parameters, so the optimizer updates the parameters in place and the
        # all-gather only brings the other ranks' slices.
        return bucket.flat.narrow(0, bucket.owned_start, bucket.owned_size)
    return owned_slice_of_flat_params(bucket, device)


def build_zero_stage(
    optimizer: OptimizerOrFactory,
    param_groups: list[dict] | None = None,
    *,
    layout: BucketLayout,
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
) -> ZeroPartitionedOptimizer:
    """The ``ZeroPartitionedOptimizer`` of ``stage`` over ``layout``'s buckets.

    ``optimizer`` is either a torch optimizer over the model's parameters (the user's: its param
    groups are re-pointed at the master shards in place) or a factory that builds one from param
    groups of master shards (a config optimizer); ``param_groups`` (dicts with "params" and
    hyper-parameters) is then required. ``reduce_scatter=False`` (DeepSpeed's
    ``zero_optimization.reduce_scatter``) reduces stage 1/2 gradients with all-reduce.
    ``offload`` puts the master shards and optimizer state on the host or NVMe (see
    ``offload/optimizer_homes.py``); with ``ratio`` < 1 the buckets left on the device are
    stepped by ``device_optimizer`` (a factory like a config ``optimizer``). ``grad_divisor``
    (default: the size of ``group``) is what the summed gradients are divided by: expert
    parameters are reduced over their expert-data-parallel group but averaged over the whole
    data-parallel world (``moe_stage.py``). ``norm_group`` (model parallelism,
    ``runtime/model_parallel.py``): the gradient norm's partial sums are summed over it too,
    after ``group``, each rank adding the parameters for which ``counts_in_norm`` is true (all
    when None), so that the norm and the skip decision are the whole model's."""
    if stage not in layout.stages:
        raise ValueError(f"{type(layout).__name__} lays out stages {layout.stages}, got {stage}")
    param_groups = trained_param_groups(optimizer, param_groups)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    owned_whole = stage == 0  # every rank owns whole buckets
    if offload is not None and owned_whole:
        raise ValueError(
            f"zero_optimization.offload_optimizer.device = {offload.device!r} needs ZeRO "
            f"stage 1, 2 or 3 (it offloads the partitioned optimizer state); got stage 0"
        )
    capacity = max(1, int(reduce_bucket_size))
    params, plan = layout.plan(
        param_groups, capacity=capacity, world_size=1 if owned_whole else world_size
    )
    buckets = _make_buckets(params, plan, rank, world_size, owned_whole)
    for bucket in buckets:
        layout.prepare(bucket)
    device = params[0].device
    # Per-element optimizer state tensors a home reserves room for (Adam's two).
    home = (offload or OptimizerOffload()).make_home(
        [b.owned_size for b in buckets], device, rank=rank, state_slots=2
    )
    reduction = layout.reduction(buckets, plan, capacity=capacity, device=device)
    masters = _make_masters(buckets, home, reduction.shard_grads, layout, device)
    shards = ShardSet(
        params=params,
        plan=plan,
        buckets=buckets,
        masters=masters,
        shard_grads=reduction.shard_grads,
        home=home,
        stage=stage,
        group=group,
        rank=rank,
        world_size=world_size,
    )
    on_device = getattr(home, "on_device", None)  # a partial offload's device buckets
    offloaded = [b for b in range(len(buckets)) if b not in set(on_device or ())]
    device_part = make_device_optimizer(
        device_optimizer,
        on_device,
        optimizer,
        offload is not None and offload.delayed_update_after is not None,
        _master_param_groups(param_groups, shards, list(on_device or ())),
    )
    optimizer = optimizer_over_masters(
        optimizer, _master_param_groups(param_groups, shards, offloaded)
    )
    scale = 1.0 / (grad_divisor or world_size)
    reducer = _make_reducer(
        shards,
        reduction,
        scatter=not owned_whole,
        scatter_method="auto" if reduce_scatter else "all_reduce",
        device=device,
        scale=scale,
    )
    gathers = layout.gathers(shards, reducer, reduction.buckets_final_after)
    if offload is None:
        stepper = InMemoryStepper(shards, gathers, optimizer)
    else:
        stepper = OffloadedStepper(
            shards,
            gathers,
            optimizer,
            offload,
            device_optimizer=device_part,
            gradient_clipping=float(gradient_clipping),
            loss_scaled=loss_scaler is not None,
        )
    home.attach(masters, optimizer)
    # Stage 0: the parameters' .grad are views of the flat gradients, reduced in place.
    in_place_grads = (
        InPlaceGradients(
            buckets,
            shards.shard_grads,
            [plan.members(b) for b in range(len(buckets))],
            group=group,
            world_size=world_size,
            scale=scale,
        )
        if grads_can_stay_in_place(shards, stepper, scale)
        else None
    )
    parts = StageParts(shards, reducer, gathers, stepper, in_place_grads)
    return ZeroPartitionedOptimizer(
        parts,
        gradient_clipping=gradient_clipping,
        loss_scaler=loss_scaler,
        norm_group=norm_group,
        counts_in_norm=counts_in_norm,
    )


def _make_buckets(params, plan: BucketPlan, rank: int, world_size: int, owned_whole: bool):
    buckets = []
    for b, size in enumerate(plan.bucket_sizes):
        members = plan.members(b)
        if owned_whole:
            start, owned = 0, size
        else:
            owned = size // world_size
            start = rank * owned
        bucket_params = [params[p] for p in members]
        dtypes = {p.dtype for p in bucket_params}
        buckets.append(
            Bucket(
                params=bucket_params,
                offsets=[plan.param_offset[p] for p in members],
                size=size,
                owned_start=start,
                owned_size=owned,
                # Low-precision parameters are gathered in their own dtype: half the bytes, and
                # the same values as gathering fp32 and casting afterwards.
                gather_dtype=dtypes.pop() if len(dtypes) == 1 else torch.float32,
            )
        )
    return buckets


def _make_masters(buckets, home, shard_grads, layout: BucketLayout, device):
    masters = []
    for index, bucket in enumerate(buckets):
        values = home.make_master(index, layout.master_slice(bucket, device))
        master = torch.nn.Parameter(values, requires_grad=True)
        # The reducer writes shard gradients on the device; offloaded masters get theirs copied
        # to the host for each step.
        if not home.offloaded(index):
            master.grad = shard_grads[index]
        masters.append(master)
    return masters


def _master_param_groups(param_groups: list[dict], shards: ShardSet, buckets: list[int]):
    """The given param groups' hyper-parameters over this rank's master shards of ``buckets``."""
    by_group: dict[int, list[torch.nn.Parameter]] = {}
    for bucket_index in buckets:
        master = shards.masters[bucket_index]
        by_group.setdefault(shards.plan.bucket_groups[bucket_index], []).append(master)
    return [
        {**{k: v for k, v in group.items() if k != "params"}, "params": by_group.get(i, [])}
        for i, group in enumerate(param_groups)
    ]


def _make_reducer(
    shards: ShardSet, reduction: Reduction, *, scatter, scatter_method, device, scale
):
    """The C++ reducer over the reduction's plan; each reduced bucket is averaged (``scale``)
    straight into its destination as soon as its collective completes, during backward."""
    extra = {} if reduction.rank_major is None else {"rank_major": reduction.rank_major}
    reducer = make_gradient_reducer(
        shards.group,
        reduction.plan,
        scatter=scatter,
        scatter_method=scatter_method,
        device=device,
        **extra,
    )
    # Only with the comms logger on.
    reducer = logged_if_enabled(reducer, reduction.plan, shards.group)
    reducer.accumulate_into(reduction.destinations, scale)
    return reducer
