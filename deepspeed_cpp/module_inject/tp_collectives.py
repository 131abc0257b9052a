"""The two collectives of tensor-parallel linear layers, as autograd functions over a TP group.

A column-parallel layer computes a slice of its output features from the whole input, so every
TP rank must see the same input, and the input's gradient is the *sum* of what each rank's slice
sends back: identity forward, all-reduce backward (``copy_to_tensor_parallel``). A row-parallel
layer computes a partial product from its slice of the input features: the partial products
are summed forward, and each rank's slice of the input gets the whole output gradient back:
all-reduce forward, identity backward (``reduce_from_tensor_parallel``). Between a column- and a
row-parallel layer (attention heads, the MLP's hidden features) nothing is exchanged.

A column-parallel output head (``lm_head`` split by vocabulary) gathers its output slices so
that the loss sees whole logits: all-gather forward along the last dimension, and backward each
rank keeps its own columns of the gradient, which every rank computed whole from the same loss
(``gather_from_tensor_parallel``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _CopyToTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        summed = tensor.contiguous().clone()
        dist.all_reduce(summed, group=group)
        return summed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromTensorParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        ctx.rank, ctx.width = dist.get_rank(group), tensor.shape[-1]
        slices = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(slices, tensor.contiguous(), group=group)
        return torch.cat(slices, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def copy_to_tensor_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` unchanged, its gradient summed over ``group``: a column-parallel input."""
    return _CopyToTensorParallel.apply(tensor, group)


def reduce_from_tensor_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` summed over ``group``, its gradient unchanged: a row-parallel output."""
    return _ReduceFromTensorParallel.apply(tensor, group)


def gather_from_tensor_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along the last dimension in rank order; the gradient
    of this rank's columns flows back: a column-parallel output made whole."""
    return _GatherFromTensorParallel.apply(tensor, group)
