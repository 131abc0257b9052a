"""ZeRO-3's bucket layout (``shard_set_builder.py``'s ``BucketLayout`` for stage 3) and the
gathers that go with it.

Every partitioned parameter is a bucket of its own whose rank-r shard is the parameter's
``ds_tensor`` (fp32 parameters are their own master weights; fp16/bf16 ones get fp32 masters
written back into ``ds_tensor`` after each step), and the optimizer steps shards only.
Gradients are reduced one fetch unit at a time: the unit's buckets form one reduction laid out
rank by rank, whose one reduce-scatter (C++ reducer) fills the unit's flat shard gradient, each
bucket's shard gradient a view into it. The persistent parameters share flat stage-2 buckets
(``FlatBuckets``), all after the partitioned ones, so they never hold back a partitioned
bucket's reduction.
"""

from __future__ import annotations

import torch

from ...ops.zero import BucketPlan, plan_buckets
from . import partition_parameters as pp
from .param_gathers import MasterGathers
from .shard_set import Bucket
from .shard_set_builder import Reduction, flat_master_slice, view_params_in_flat


def is_partitioned_bucket(bucket: Bucket) -> bool:
    """Whether ``bucket`` is one partitioned parameter (its shard the bucket's)."""
    return len(bucket.params) == 1 and pp.is_partitioned(bucket.params[0])


class PartitionedBuckets:
    """Stage 3's ``BucketLayout`` (see the module docstring). ``model_order``: ``id(param)`` ->
    its position in the model's registration order; ``unit_of_param``: ``id(param)`` -> the
    fetch unit whose gradients it is reduced with (a parameter in none is reduced on its own);
    ``units_reduced_apart``: sub-groups may be stepped during backward (``step_during_backward``
    not off), so a unit's gradients are never reduced together with another unit's."""

    stages = (3,)

    def __init__(
        self,
        model_order: dict[int, int],
        unit_of_param: dict[int, int] | None,
        *,
        units_reduced_apart: bool,
    ) -> None:
        self.model_order = model_order
        self.unit_of_param = unit_of_param or {}
        self.units_reduced_apart = units_reduced_apart

    def plan(self, param_groups, *, capacity, world_size):
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
            capacity=capacity,
            world_size=world_size,
            alignment=pp.SHARD_ALIGNMENT,
            alone=[True] * len(partitioned) + [False] * len(persistent),
        )
        return [p for _, p in members], plan

    def prepare(self, bucket: Bucket) -> None:
        if not is_partitioned_bucket(bucket):
            view_params_in_flat(bucket)
            for param in bucket.params:  # a persistent parameter's ds_tensor is itself
                if pp.is_zero_param(param):
                    param.ds_tensor = param.data

    def master_slice(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        if not is_partitioned_bucket(bucket):
            return flat_master_slice(bucket, device)
        param = bucket.params[0]
        shard = pp.read_shard(param)
        if getattr(param, "ds_home", None) is not None:
            return shard.float().clone()  # the shard's home is not the optimizer's
        return shard if shard.dtype == torch.float32 else shard.float()

    def gathers(self, shards, reducer, buckets_final_after) -> PartitionedGathers:
        return PartitionedGathers(shards, reducer, buckets_final_after)

    # --- one reduction per unit -------------------------------------------------------------------
    def reduction(
        self, buckets: list[Bucket], plan: BucketPlan, *, capacity: int, device
    ) -> Reduction:
        """Per bucket, a view into its reduction run's flat shard gradient (see ``_runs``): one
        reduce-scatter fills a whole run. A partitioned run is laid out rank by rank (rank r's
        part is its parameters' shards r back to back, the layout a unit's gather reads), so its
        one reduce-scatter lands in the run's flat shard gradient."""
        runs = self._runs(buckets, capacity)
        run_grads: list[torch.Tensor] = []  # the reducer's destinations
        grads: list[torch.Tensor | None] = [None] * len(buckets)
        for run in runs:
            sizes = [buckets[b].owned_size for b in run]
            flat = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
            run_grads.append(flat)
            for bucket, view in zip(run, flat.split(sizes)):
                grads[bucket] = view
        count = len(plan.param_numel)
        param_bucket, param_offset, rank_major = [0] * count, list(plan.param_offset), [0] * count
        members: list[list[int]] = [[] for _ in buckets]
        for param, bucket in enumerate(plan.param_bucket):
            members[bucket].append(param)
        sizes, groups = [], []
        for run_index, run in enumerate(runs):
            offset = 0
            partitioned = is_partitioned_bucket(buckets[run[0]])
            for bucket in run:
                for param in members[bucket]:
                    param_bucket[param] = run_index
                    if partitioned:
                        param_offset[param] = offset
                        rank_major[param] = buckets[bucket].owned_size
                offset += buckets[bucket].owned_size
            sizes.append(sum(plan.bucket_sizes[b] for b in run))
            groups.append(plan.bucket_groups[run[0]])
        # Once the first k runs are reduced, the buckets before the first bucket of any later
        # run are final (a suffix minimum over the runs' first buckets).
        final_after = [len(buckets)] * (len(runs) + 1)
        for index in reversed(range(len(runs))):
            final_after[index] = min(final_after[index + 1], runs[index][0])
        return Reduction(
            shard_grads=grads,
            plan=BucketPlan(
                param_bucket, param_offset, list(plan.param_numel), sizes, groups, plan.world_size
            ),
            destinations=run_grads,
            rank_major=rank_major,
            buckets_final_after=final_after,
        )

    def _runs(self, buckets: list[Bucket], capacity: int) -> list[list[int]]:
        """The buckets in runs reduced by one collective each: the partitioned buckets (one
        parameter each) of one fetch unit, in bucket order, whatever ``reduce_bucket_size`` (the
        unit is gathered whole anyway, so its whole gradient costs what its gather does: one
        reduce-scatter per unit, as FSDP2); then consecutive partitioned runs merged up to
        ``reduce_bucket_size`` elements (a deep model's small blocks: one collective for many,
        as DeepSpeed's reduce bucket); every persistent bucket alone. Where sub-groups may be
        stepped during backward, a unit's buckets are instead cut into runs of at most
        ``reduce_bucket_size`` and never merged across units (``_split``). The
        buckets themselves keep their order, so masters, optimizer state and checkpoint layout
        stay one per parameter.

        The reducer launches runs strictly in order, so they are ordered by their last bucket
        (buckets follow the usual arrival of gradients): a unit whose members' gradients come
        at different times (a root unit holding every block's norm) is reduced once its last
        one arrives, without holding back the runs completed before it."""
        by_unit: dict[object, list[int]] = {}
        for index, bucket in enumerate(buckets):
            key = (
                self.unit_of_param.get(id(bucket.params[0]), ("alone", index))
                if is_partitioned_bucket(bucket)
                else ("persistent", index)
            )
            by_unit.setdefault(key, []).append(index)
        if self.units_reduced_apart:
            pieces = [piece for run in by_unit.values() for piece in _split(run, buckets, capacity)]
            return sorted(pieces, key=lambda run: run[-1])
        runs: list[list[int]] = []
        for run in sorted(by_unit.values(), key=lambda run: run[-1]):
            previous = runs[-1] if runs else None
            if (
                previous is not None
                and is_partitioned_bucket(buckets[run[0]])
                and is_partitioned_bucket(buckets[previous[0]])
                and _size(previous, buckets) + _size(run, buckets) <= capacity
            ):
                previous.extend(run)
                previous.sort()  # a run's first bucket is its lowest (see ``reduction``)
            else:
                runs.append(list(run))
        return runs


def _size(run: list[int], buckets: list[Bucket]) -> int:
    return sum(buckets[index].size for index in run)


def _split(run: list[int], buckets: list[Bucket], capacity: int) -> list[list[int]]:
    """A unit's buckets in pieces of at most ``capacity`` (``reduce_bucket_size``) elements (a
    bucket larger than that alone): where sub-groups are stepped during backward, each piece
    reduced lets its sub-groups step while the rest of the unit's backward runs."""
    pieces = [[run[0]]]
    for index in run[1:]:
        if _size(pieces[-1], buckets) + buckets[index].size <= capacity:
            pieces[-1].append(index)
        else:
            pieces.append([index])
    return pieces


class PartitionedGathers(MasterGathers):
    """The ``ParamGathers`` of stage 3: a partitioned bucket's values are its parameter's shard
    (``ds_tensor``, or its offloaded home), nothing to all-gather after a step; persistent
    buckets are gathered as stages 0-2 do."""

    _step_calls: list[list[int]] | None = None

    def owned_slice_of_params(self, bucket: Bucket, device: torch.device) -> torch.Tensor:
        if not is_partitioned_bucket(bucket):
            return super().owned_slice_of_params(bucket, device)
        return pp.read_shard(bucket.params[0]).float().clone()

    def owned_device_target(self, bucket: Bucket) -> torch.Tensor:
        if not is_partitioned_bucket(bucket):
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
            buckets = self.shards.buckets
            together = [i for i, b in enumerate(buckets) if is_partitioned_bucket(b)]
            calls = [together] if together else []
            calls += [[i] for i, b in enumerate(buckets) if not is_partitioned_bucket(b)]
            self._step_calls = calls
        return self._step_calls

    def launch_gather(self, bucket: Bucket, master: torch.Tensor):
        if not is_partitioned_bucket(bucket):
            return super().launch_gather(bucket, master)
        # The next forward gathers the shard; only a low-precision copy needs writing.
        param = bucket.params[0]
        if getattr(param, "ds_home", None) is not None or (
            param.ds_tensor.data_ptr() != master.data_ptr()
        ):
            pp.store_shard(param, master.detach())
        return bucket, None, [], True
