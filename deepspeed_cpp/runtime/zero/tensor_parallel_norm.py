"""The whole model's gradient norm when the model is split for tensor parallelism.

A TP rank's shard gradients hold its slices of the split parameters and a full copy of every
replicated one (embeddings, norms, row-parallel biases: the same gradient on every TP rank).
Summed over the TP group, the slices' squares make the split parameters' squares once, but the
replicated parameters' squares would count ``tp`` times: each rank counts its replicated part
``1 / tp`` times before the sum.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...module_inject.layers import is_tensor_parallel_param


def replicated_squares(stage) -> torch.Tensor:
    """The sum of squares (float64) of this rank's fragments of replicated parameters."""
    total = torch.zeros(1, dtype=torch.float64, device=stage.shard_grads[0].device)
    for param in stage.params:
        if is_tensor_parallel_param(param):
            continue
        fragment = stage.fragment_of(param)
        if fragment.numel:
            piece = stage.shard_grads[fragment.bucket].narrow(
                0, fragment.master_start, fragment.numel
            )
            total += piece.double().pow(2).sum()
    return total


def sum_over_tensor_parallel(stage, squares: torch.Tensor) -> torch.Tensor:
    """``squares`` (this rank's shard gradients' sum of squares) made the TP group's share of
    the whole model's: replicated parameters weighted 1 / tp, then summed over the TP group."""
    group = stage.tensor_parallel_group
    size = dist.get_world_size(group)
    if size == 1:
        return squares
    squares = squares - (1.0 - 1.0 / size) * replicated_squares(stage).to(squares.device)
    with named_collective("all_reduce of the gradient norm over the tensor-parallel group"):
        dist.all_reduce(squares, group=group)
    return squares
