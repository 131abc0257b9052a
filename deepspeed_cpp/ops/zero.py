"""Python entry points of csrc/zero: flat buffers, bucket plans, grad reducer, fetch schedule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .op_builder import ZeroBuilder
from .op_loader import OpLoader


def load_zero() -> None:
    """Loads the op library (pre-built or JIT). Called before first use, outside torch.compile."""
    _op.load()


def _fake_nothing(*args) -> None:
    return None


def _fake_plan(numels, groups, capacity, world_size, alignment, alone=()):
    ctx = torch.library.get_ctx()
    num_buckets = ctx.new_dynamic_size()
    slots = torch.empty((len(numels), 2), dtype=torch.long)
    sizes = torch.empty((num_buckets,), dtype=torch.long)
    return slots, sizes, torch.empty((num_buckets,), dtype=torch.long)


_op = OpLoader(
    ZeroBuilder(),
    {
        "zero_flatten_into": _fake_nothing,
        "zero_unflatten_from": _fake_nothing,
        "zero_plan_buckets": _fake_plan,
    },
)


@dataclass(frozen=True)
class BucketPlan:
    """Where every parameter lives in the flat buckets; identical on every rank."""

    param_bucket: list[int]
    param_offset: list[int]
    param_numel: list[int]
    bucket_sizes: list[int]
    bucket_groups: list[int]
    world_size: int

    def shard_size(self, bucket: int) -> int:
        return self.bucket_sizes[bucket] // self.world_size

    def members(self, bucket: int) -> list[int]:
        return [p for p, b in enumerate(self.param_bucket) if b == bucket]


def plan_buckets(
    numels: Sequence[int],
    groups: Sequence[int],
    *,
    capacity: int,
    world_size: int,
    alignment: int = 16,
    alone: Sequence[bool] | None = None,
) -> BucketPlan:
    """Packs parameters (in the given order) into flat buckets of at most `capacity` elements.

    A bucket never mixes parameter groups; a parameter larger than `capacity`, or one whose
    ``alone[i]`` is true (ZeRO-3's partitioned parameters), gets a bucket of its own; each bucket
    is padded to a multiple of ``world_size * alignment`` elements so that it splits into equal,
    aligned shards, one per rank. The plan is made once, by csrc/zero/bucket_plan.cpp, and handed
    as is to the C++ reducer (``make_gradient_reducer``).
    """
    if not _op.ready:
        load_zero()
    slots, sizes, bucket_groups = torch.ops.deepspeed_cpp.zero_plan_buckets.default(
        list(numels),
        list(groups),
        int(capacity),
        int(world_size),
        int(alignment),
        [int(bool(flag)) for flag in alone] if alone is not None else [],
    )
    return BucketPlan(
        slots[:, 0].tolist(),
        slots[:, 1].tolist(),
        list(numels),
        sizes.tolist(),
        bucket_groups.tolist(),
        int(world_size),
    )


def flatten_into(tensors: Sequence[torch.Tensor], flat: torch.Tensor, offsets: Sequence[int]):
    """Copies each tensor (any shape, any dtype) into the 1-D ``flat`` at its element offset."""
    if not _op.ready:
        load_zero()
    torch.ops.deepspeed_cpp.zero_flatten_into.default(list(tensors), flat, list(offsets))


def unflatten_from(flat: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]):
    """Copies slices of the 1-D ``flat`` back into each tensor, in place (dtype converted)."""
    if not _op.ready:
        load_zero()
    torch.ops.deepspeed_cpp.zero_unflatten_from.default(flat, list(tensors), list(offsets))


def make_gradient_reducer(
    group,
    plan: BucketPlan,
    *,
    scatter: bool,
    scatter_method: str = "auto",
    device: torch.device | str = "cpu",
    rank_major: Sequence[int] | None = None,
):
    """A ``torch.classes.deepspeed_cpp.GradientReducer`` over ``group`` following ``plan``.

    ``scatter_method`` ("auto", "reduce_scatter" or "all_reduce") says how scattered buckets are
    reduced (see csrc/zero/grad_reducer.h); ``device`` is where the gradients live.
    ``rank_major[p]`` > 0 lays parameter ``p`` out rank by rank, that many elements per rank at
    ``plan.param_offset[p]`` of its bucket's shard (ZeRO-3's one reduction per unit; see
    ``lay_out_rank_major`` in grad_reducer.h). Built collectively: every rank of ``group`` must
    call this at the same point.
    """
    if not _op.ready:
        load_zero()
    reducer = torch.classes.deepspeed_cpp.GradientReducer(
        group.group_name,
        plan.param_bucket,
        plan.param_offset,
        plan.param_numel,
        plan.bucket_sizes,
        scatter,
        scatter_method,
        str(device),
    )
    if rank_major is not None:
        reducer.lay_out_rank_major([int(n) for n in rank_major])
    return reducer


def make_fetch_schedule(
    unit_numel: Sequence[int],
    *,
    prefetch_bucket_size: int,
    max_live_parameters: int,
    max_reuse_distance: int,
):
    """A ``torch.classes.deepspeed_cpp.FetchSchedule``: ZeRO-3's gather/release decisions.

    ``unit_numel[u]`` is the element count of fetch unit ``u``; budgets are in elements. Per
    module: ``on_use(u)`` returns the units to gather now (``u`` first if released, then
    prefetches while replaying a recorded trace); ``on_done(u)`` says whether to release ``u``;
    ``end_pass()`` returns the units still gathered. Decisions depend only on the call sequence,
    so all ranks agree. See csrc/zero/fetch_schedule.h for the rules.
    """
    if not _op.ready:
        load_zero()
    return torch.classes.deepspeed_cpp.FetchSchedule(
        [int(n) for n in unit_numel],
        int(prefetch_bucket_size),
        int(max_live_parameters),
        int(max_reuse_distance),
    )
