"""The two questions a ZeRO step asks of every rank's shard gradients before it steps: did any
gradient overflow (fp16), and what is the global gradient norm (clipping, and a non-finite norm
skips the step). Each rank holds other shards, so the partial answers are summed over the stage's
group (stage 0 holds whole gradients: nothing to sum) and, under model parallelism, over the
model-parallel group, each rank counting only the parameters ``counts_in_norm`` gives it
(``norm_ranges.py``)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from .norm_ranges import counted_ranges, norm_of_ranges
from .shard_set import ShardSet


class ShardGradientChecks:
    """Overflow flag and global norm over a ``ShardSet``'s shard gradients."""

    def __init__(
        self,
        shards: ShardSet,
        norm_group: dist.ProcessGroup | None,
        counts_in_norm: Callable[[torch.nn.Parameter], bool] | None,
    ) -> None:
        self.shards = shards
        self.norm_group = norm_group
        self._ranges = counted_ranges(shards.buckets, counts_in_norm)

    def _sum_over_shards(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """Sums ``value`` over the ranks holding other shards (stage 0 holds whole gradients)
        and over the model-parallel ranks holding other parts of the model."""
        if self.shards.stage != 0 and self.shards.world_size > 1:
            with named_collective(what):
                dist.all_reduce(value, group=self.shards.group)
        if self.norm_group is not None:
            with named_collective(f"{what} over the model-parallel group"):
                dist.all_reduce(value, group=self.norm_group)
        return value

    def overflow_on_any_rank(self) -> bool:
        shard_grads = self.shards.shard_grads
        local = torch.zeros(1, dtype=torch.float32, device=shard_grads[0].device)
        for grad in shard_grads:
            local += (~torch.isfinite(grad)).any().float()
        return bool(self._sum_over_shards(local, "all_reduce of the overflow flag").item() > 0)

    def global_norm(self, norms: list[torch.Tensor]) -> float:
        """The whole model's gradient norm from ``norms``, this rank's shard gradients' norms
        (one fused read of the shards, float32 as torch's clip_grad_norm_): their squares are
        summed in float64 across shards and ranks."""
        squares = torch.stack(self._counted(norms)).double().pow(2).sum().reshape(1)
        total = self._sum_over_shards(squares, "all_reduce of the gradient norm")
        return math.sqrt(float(total.item()))

    def group_norms(self, norms: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per param group (bucket b belongs to group ``plan.bucket_groups[b]``): the
        norm of the group's whole gradient, from ``norms`` as in ``global_norm`` (collective).
        A float32 scalar tensor each; the global norm is the norm of these."""
        bucket_groups = self.shards.plan.bucket_groups
        squares = torch.zeros(max(bucket_groups) + 1, dtype=torch.float64)
        for bucket, norm in enumerate(self._counted(norms)):
            squares[bucket_groups[bucket]] += float(norm) ** 2
        squares = squares.to(self.shards.shard_grads[0].device)
        total = self._sum_over_shards(squares, "all_reduce of the per-group gradient norms")
        return list(total.sqrt().float().unbind())

    def _counted(self, norms: list[torch.Tensor]) -> list[torch.Tensor]:
        if self._ranges is None:
            return list(norms)
        # Parameters another model-parallel rank counts are left out of this rank's part.
        return [
            norm if ranges is None else norm_of_ranges(grad, ranges)
            for norm, grad, ranges in zip(norms, self.shards.shard_grads, self._ranges)
        ]
