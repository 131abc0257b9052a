"""The initial broadcast of ``initialize()``: every rank starts from its data-parallel group's
first rank's weights and buffers, as data parallelism requires (model-parallel ranks hold other
parts and are not broadcast to), and expert-parallel MoE experts from their own
expert-data-parallel group's first rank."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ..comm.collective_errors import named_collective
from ..utils import groups as moe_groups
from .zero.moe_stage import DENSE, expert_set_of


def broadcast_initial_weights(module: torch.nn.Module, parallel, group) -> None:
    """Broadcasts ``module``'s parameters and buffers over ``group`` (the data-parallel group
    of ``parallel``, a ``ModelParallelGroups``), each collective named should it fail."""
    if parallel.dp_world_size == 1:
        return
    source = parallel.broadcast_src
    tensors = list(module.parameters()) + list(module.buffers())
    with torch.no_grad():
        for index, tensor in enumerate(tensors):
            key = expert_set_of(tensor) if isinstance(tensor, torch.nn.Parameter) else DENSE
            what = _initial_broadcast_label(index, len(tensors), tensor, key)
            with named_collective(what):
                if key == DENSE:
                    dist.broadcast(tensor.data, src=source, group=group)
                else:
                    # ep_size > 1 experts differ between expert-parallel ranks: each is a
                    # replica only within its expert-data-parallel group, whose first rank's
                    # copy every member starts from.
                    dist.broadcast(
                        tensor.data,
                        src=moe_groups._get_expert_broadcast_src_rank(key),
                        group=moe_groups._get_expert_data_parallel_group(key),
                    )


def _initial_broadcast_label(
    index: int, count: int, tensor: torch.Tensor, key
) -> Callable[[], str]:
    """Names one broadcast of initialize(); formatted only if that broadcast fails."""
    where = "" if key == DENSE else f", expert set {key}"
    return lambda: (
        f"broadcast of the initial weights in initialize() (tensor {index} of {count}, "
        f"shape {list(tensor.shape)}{where})"
    )
