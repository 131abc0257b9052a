"""The collectives DeepSpeed scripts call through ``deepspeed.comm`` (``import deepspeed.comm as
dist``), under DeepSpeed's names and signatures.

Each is torch.distributed's own collective, inside ``named_collective`` so that a rank that
stopped answering is named instead of surfacing as the backend's generic text. Nothing else is
added here: the comms logger (``comms_logger.py``) times them through torch.distributed while it
is on; DeepSpeed's ``prof``/``log_name``/``debug`` keywords are accepted and ignored.
"""

from __future__ import annotations

import torch.distributed as dist

from .collective_errors import named_collective

ReduceOp = dist.ReduceOp


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, **_profile):
    with named_collective("all_reduce"):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None, **_profile):
    """DeepSpeed's low-latency all-reduce for inference; here the ordinary one, in place."""
    with named_collective("inference_all_reduce"):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def broadcast(tensor, src, group=None, async_op=False, **_profile):
    with named_collective(lambda: f"broadcast from rank {src}"):
        return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False, **_profile):
    with named_collective("all_gather"):
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor, tensor, group=None, async_op=False, **_profile):
    with named_collective("all_gather_into_tensor"):
        return dist.all_gather_into_tensor(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False, **_profile
):
    with named_collective("reduce_scatter_tensor"):
        return dist.reduce_scatter_tensor(
            output_tensor, tensor, op=op, group=group, async_op=async_op
        )


def all_to_all_single(
    output,
    tensor,
    output_split_sizes=None,
    input_split_sizes=None,
    group=None,
    async_op=False,
    **_profile,
):
    with named_collective("all_to_all_single"):
        return dist.all_to_all_single(
            output, tensor, output_split_sizes, input_split_sizes, group=group, async_op=async_op
        )


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False, **_profile):
    with named_collective(lambda: f"reduce to rank {dst}"):
        return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def get_world_group() -> dist.ProcessGroup:
    return dist.group.WORLD


def get_global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def get_backend(group=None) -> str:
    return dist.get_backend(group)


def has_all_gather_into_tensor() -> bool:
    return hasattr(dist, "all_gather_into_tensor")


def has_reduce_scatter_tensor() -> bool:
    return hasattr(dist, "reduce_scatter_tensor")


def is_available() -> bool:
    return dist.is_available()
