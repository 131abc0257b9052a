"""The two collectives of tensor-parallel linear layers, as autograd functions over a TP group.

A column-parallel layer computes a slice of its output features from the whole input, so every
TP rank must see the same input, and the input's gradient is the *sum* of what each rank's slice
sends back: identity forward, all-reduce backward (``copy_to_tensor_parallel``). A row-parallel
layer computes a partial product from its slice of the input features: the partial products
are summed forward, and each rank's slice of the input gets the whole output gradient back:
all-reduce forward, identity backward (``reduce_from_tensor_parallel``). Between a column- and a
row-parallel layer (attention heads, the MLP's hidden features) nothing is exchanged.
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


def copy_to_tensor_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` unchanged, its gradient summed over ``group``: a column-parallel input."""
    return _CopyToTensorParallel.apply(tensor, group)


def reduce_from_tensor_parallel(tensor: torch.Tensor, group) -> torch.Tensor:
    """``tensor`` summed over ``group``, its gradient unchanged: a row-parallel output."""
    return _ReduceFromTensorParallel.apply(tensor, group)
