"""Tensor-parallel linear layers (DeepSpeed's ``LinearLayer`` and ``LinearAllreduce``) and the
slicing rule their parameters follow.

``LinearLayer`` is column-parallel: each TP rank holds a slice of the output features (weight
rows of an ``nn.Linear``, weight columns of transformers' ``Conv1D``, whose weight is stored
transposed) and of the bias; its output stays split. ``LinearAllreduce`` is row-parallel: each
rank holds a slice of the input features, the partial products are summed over the TP group, and
the bias, kept whole on every rank, is added once after the sum.

A sliced parameter carries Megatron's attributes, which the gradient norm and the consolidation
of checkpoints read: ``tensor_model_parallel = True``, ``partition_dim`` (the dimension of the
stored tensor that is split) and ``partition_stride`` (how many equal blocks that dimension is
made of, each split on its own: 3 for GPT-2's fused q/k/v ``c_attn``, so that every rank gets
its heads' queries, keys and values, not the first third of the fused features).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .tp_collectives import (
    copy_to_tensor_parallel,
    gather_from_tensor_parallel,
    reduce_from_tensor_parallel,
)


def is_tensor_parallel_param(param: torch.Tensor) -> bool:
    """Whether ``param`` is a TP rank's slice (as opposed to a copy held whole on every rank)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def shard_tensor(full: torch.Tensor, dim: int, rank: int, world: int, blocks: int = 1):
    """Rank ``rank``'s slice of ``full`` along ``dim``: ``dim`` is cut into ``blocks`` equal
    blocks and each block into ``world`` equal parts; the slice is part ``rank`` of every block,
    concatenated. ValueError when the sizes do not divide."""
    size = full.shape[dim]
    if size % (blocks * world) != 0:
        raise ValueError(
            f"cannot split dimension {dim} of size {size} (shape {list(full.shape)}) into "
            f"{blocks} block(s) of {world} tensor-parallel slices: expected a multiple of "
            f"{blocks * world}"
        )
    part = size // (blocks * world)
    block = size // blocks
    pieces = [full.narrow(dim, b * block + rank * part, part) for b in range(blocks)]
    return torch.cat(pieces, dim=dim).clone()


def unshard_tensors(slices: list[torch.Tensor], dim: int, blocks: int = 1) -> torch.Tensor:
    """The whole tensor from every rank's slice (in rank order): the inverse of shard_tensor."""
    per_block = [torch.chunk(piece, blocks, dim=dim) for piece in slices]
    return torch.cat([per_block[r][b] for b in range(blocks) for r in range(len(slices))], dim=dim)


def mark_tensor_parallel(param: torch.nn.Parameter, dim: int, blocks: int = 1) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = dim
    param.partition_stride = blocks


def _sliced_parameter(tensor, dim, rank, world, blocks) -> torch.nn.Parameter:
    piece = torch.nn.Parameter(
        shard_tensor(tensor.detach(), dim, rank, world, blocks), tensor.requires_grad
    )
    mark_tensor_parallel(piece, dim, blocks)
    return piece


class _TensorParallelLinear(torch.nn.Module):
    """Shared by both layers: the weight in the layout of the module it replaces (``transposed``
    for ``Conv1D``'s (in, out)), so that state-dict names and the full shapes stay the model's."""

    def __init__(self, weight, bias, *, transposed: bool, group, tp_rank: int, tp_size: int):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.transposed = transposed
        self.mp_group = group
        self.tp_rank = tp_rank
        self.tp_world_size = tp_size
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
        self.in_features = weight.shape[in_dim]
        self.out_features = weight.shape[out_dim]

    def _matmul(self, x: torch.Tensor, bias) -> torch.Tensor:
        if not self.transposed:
            return F.linear(x, self.weight, bias)
        # transformers' Conv1D: x @ weight (+ bias), weight stored (in, out).
        flat = x.reshape(-1, x.shape[-1])
        out = torch.addmm(bias, flat, self.weight) if bias is not None else flat @ self.weight
        return out.view(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, tp_rank={self.tp_rank}/{self.tp_world_size}"
            + (", conv1d_layout" if self.transposed else "")
        )

    @staticmethod
    def _layout_of(module: torch.nn.Module) -> bool:
        if isinstance(module, torch.nn.Linear):
            return False
        if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):
            return True
        raise TypeError(
            f"tensor parallelism splits nn.Linear and transformers' Conv1D layers, not "
            f"{type(module).__name__}"
        )


class LinearLayer(_TensorParallelLinear):
    """Column-parallel: this rank's output features from the whole (replicated) input; with
    ``gather_output`` (DeepSpeed's name; the output head) every rank's features gathered."""

    gather_output = False

    @classmethod
    def from_module(cls, module, group, tp_rank: int, tp_size: int, blocks: int = 1,
                    gather_output: bool = False):  # fmt: skip
        transposed = cls._layout_of(module)
        out_dim = 1 if transposed else 0
        if gather_output and blocks != 1:
            raise ValueError("a gathered column-parallel output cannot have fused blocks")
        weight = _sliced_parameter(module.weight, out_dim, tp_rank, tp_size, blocks)
        bias = None
        if module.bias is not None:
            bias = _sliced_parameter(module.bias, 0, tp_rank, tp_size, blocks)
        layer = cls(weight, bias, transposed=transposed, group=group, tp_rank=tp_rank,
                    tp_size=tp_size)  # fmt: skip
        layer.gather_output = gather_output
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(copy_to_tensor_parallel(x, self.mp_group), self.bias)
        return gather_from_tensor_parallel(out, self.mp_group) if self.gather_output else out

    def extra_repr(self) -> str:
        return super().extra_repr() + (", gather_output" if self.gather_output else "")


class LinearAllreduce(_TensorParallelLinear):
    """Row-parallel: partial products of this rank's input features, summed over the TP group;
    the whole bias is added once, after the sum."""

    @classmethod
    def from_module(cls, module, group, tp_rank: int, tp_size: int, blocks: int = 1):
        transposed = cls._layout_of(module)
        in_dim = 0 if transposed else 1
        weight = _sliced_parameter(module.weight, in_dim, tp_rank, tp_size, blocks)
        bias = module.bias  # replicated: every rank's copy gets the same gradient
        return cls(weight, bias, transposed=transposed, group=group, tp_rank=tp_rank,
                   tp_size=tp_size)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = reduce_from_tensor_parallel(self._matmul(x, None), self.mp_group)
        return out + self.bias if self.bias is not None else out
