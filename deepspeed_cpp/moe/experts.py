"""DeepSpeed's ``Experts``: this rank's copies of the expert module, their parameters marked as
expert parameters (``allreduce = False``, ``group_name = "ep_size_<n>"``) as DeepSpeed marks
them, so that optimizers and the engine can tell them from the shared ones."""

from __future__ import annotations

import copy

import torch
from torch import nn


def check_unmarked(expert: nn.Module, group_name: str) -> None:
    """ValueError if a parameter of ``expert`` is already an expert parameter of another group."""
    for name, param in expert.named_parameters():
        marked = getattr(param, "group_name", None)
        if getattr(param, "allreduce", True) is False and marked != group_name:
            raise ValueError(
                f"expert parameter {name!r} is already marked for expert group {marked!r} "
                f"(allreduce=False); an MoE layer with this ep_size marks its experts "
                f"group_name={group_name!r}: pass a fresh expert module, not one taken from "
                "another MoE layer"
            )


class Experts(nn.Module):
    """``num_local_experts`` deep copies of ``expert``; input ``[ep, local experts, C, M]``."""

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name=None):
        super().__init__()
        if expert_group_name is not None:
            check_unmarked(expert, expert_group_name)
        self.deepspeed_experts = nn.ModuleList(
            [copy.deepcopy(expert) for _ in range(num_local_experts)]
        )
        self.num_local_experts = num_local_experts
        for local in self.deepspeed_experts:
            for param in local.parameters():
                param.allreduce = False
                param.group_name = expert_group_name

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        chunks = inputs.chunk(self.num_local_experts, dim=1)
        outputs = []
        for chunk, expert in zip(chunks, self.deepspeed_experts):
            out = expert(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)  # drop a returned bias
        return torch.cat(outputs, dim=1)
