"""Moving tokens to their experts' capacity slots and back, and between expert-parallel ranks.

DeepSpeed builds dense ``[tokens, experts, capacity]`` one-hot tensors and contracts them with
einsum; here the gating op's (expert, position, kept) index the slots directly, which does the
same arithmetic on kept tokens only (every slot holds at most one token, so no sum is
reordered) in O(tokens * k * model_dim) instead of O(tokens * experts * capacity * model_dim).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collective_errors import named_collective
from ..ops.moe import Gating


class Slots:
    """Where the kept (token, slot) pairs of a batch go: flat slot ``expert * capacity + position``
    of a ``[experts * capacity, M]`` buffer, and which token and combine weight each one has."""

    def __init__(self, routing: Gating, num_experts: int, capacity: int):
        kept = routing.kept.flatten()
        k = routing.kept.shape[1]
        token = torch.arange(routing.kept.shape[0], device=kept.device).repeat_interleave(k)
        self.token = token[kept]
        self.slot = (routing.expert * capacity + routing.position).flatten()[kept]
        self.weight = routing.weight.flatten()[kept]
        self.num_slots = num_experts * capacity

    def dispatch(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[T, M]`` -> ``[experts * capacity, M]``; empty slots are zeros."""
        buffer = tokens.new_zeros((self.num_slots, tokens.shape[1]))
        return buffer.index_copy(0, self.slot, tokens[self.token])

    def combine(self, expert_output: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``[experts * capacity, M]`` -> ``[T, M]``: each token's weighted expert outputs."""
        weighted = expert_output[self.slot] * self.weight.to(expert_output.dtype).unsqueeze(1)
        out = expert_output.new_zeros((num_tokens, expert_output.shape[1]))
        return out.index_add(0, self.token, weighted)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over equal splits of dim 0; its gradient is the reverse exchange, which
    with equal splits is the same all-to-all."""

    @staticmethod
    def forward(ctx, group, input):
        ctx.group = group
        input = input.contiguous()
        output = torch.empty_like(input)
        with named_collective(
            lambda: (
                f"all_to_all of MoE tokens (shape {list(input.shape)}) over "
                f"{dist.get_world_size(group)} expert-parallel ranks"
            )
        ):
            dist.all_to_all_single(output, input, group=group)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        return None, _AllToAll.apply(ctx.group, grad_output)


def all_to_all(group, tensor: torch.Tensor) -> torch.Tensor:
    """Exchanges equal dim-0 chunks with every rank of ``group`` (identity for one rank)."""
    if group is None or dist.get_world_size(group) == 1:
        return tensor
    return _AllToAll.apply(group, tensor)
