"""DeepSpeed's names for a ZeRO optimizer's parameter groups and fp32 partitions, as read-only
views of ours.

Monitoring callbacks and scripts written for DeepSpeed read these off ``engine.optimizer``
(checking where the fp32 partitions live, scanning their gradients for inf/NaN, listing the
parameters each group trains): ``bit16_groups`` and ``single_partition_of_fp32_groups`` of
DeepSpeed's stage-1/2 optimizer, ``fp16_groups`` and ``fp32_partitioned_groups_flat`` of its
stage-3 one. Each call builds a new list of the engine's own tensors: the model's parameters,
and the fp32 master shards the optimizer steps (whose ``.grad`` is the reduced shard gradient
until the step). Our shards are per bucket, not per param group: where a group's parameters
span several buckets, its fp32 partition is several tensors here (one per bucket, in order).
"""

from __future__ import annotations

import torch

# Each a function of the stage (``ZeroPartitionedOptimizer``: ``buckets``, ``masters``, ``plan``,
# ``optimizer``), made a property there: plain functions, so the stage keeps one project base.


def bit16_groups(stage) -> list[list[torch.nn.Parameter]]:
    """Per param group of the optimizer, its trainable parameters in the order given."""
    groups: list[list[torch.nn.Parameter]] = [[] for _ in stage.optimizer.param_groups]
    for bucket, group in zip(stage.buckets, stage.plan.bucket_groups):
        groups[group].extend(bucket.params)
    # Buckets hold each group's parameters in reverse (gradient-ready) order.
    return [list(reversed(params)) for params in groups]


def fp32_shards(stage) -> list[torch.nn.Parameter]:
    """This rank's fp32 master shards, one per bucket: stages 1-2's
    ``single_partition_of_fp32_groups`` (in DeepSpeed one per param group) and stage 3's
    ``fp32_partitioned_groups_flat`` (one per sub-group; keys of ``optimizer.state``)."""
    return list(stage.masters)


def fp16_groups(stage) -> list[list[torch.nn.Parameter]]:
    """Stage 3's sub-groups: the parameters of each bucket (registration order), matching
    ``fp32_partitioned_groups_flat`` index by index."""
    return [list(reversed(bucket.params)) for bucket in stage.buckets]
