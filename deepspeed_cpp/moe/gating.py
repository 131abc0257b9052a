"""DeepSpeed's ``TopKGate``: the gate projection, noisy policies, capacities and the auxiliary
load-balancing loss around the gating op (``torch.ops.deepspeed_cpp.moe_gating``).

The random draws (Gumbel noise, jitter, random-token-selection priorities) come from torch's
default generator of the logits' device, so ``torch.manual_seed`` makes a run reproducible.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collective_errors import named_collective
from ..ops.moe import Gating, moe_gating

NOISY_GATE_POLICIES = (None, "Jitter", "RSample")
JITTER_EPSILON = 1e-2  # DeepSpeed's multiplicative_jitter


class GateOutput(NamedTuple):
    l_aux: torch.Tensor  # scalar, differentiable w.r.t. the gate's weight
    routing: Gating  # per (token, slot) decisions, [tokens, k] each
    capacity: int  # tokens per expert in the dispatch buffer
    exp_counts: torch.Tensor  # int64 [experts] on the CPU: choices per expert before any drop


def capacity_for(tokens: int, experts: int, capacity_factor: float, min_capacity: int, k: int):
    """DeepSpeed's ``_capacity``: ceil(tokens / experts * factor) (top-2: factor * 2), at least
    ``min_capacity``."""
    return max(math.ceil((tokens / experts) * (capacity_factor * k)), int(min_capacity))


def gumbel_noise(like: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) samples of ``like``'s shape, dtype and device (-log(-log U))."""
    uniform = torch.rand_like(like)
    tiny = torch.finfo(like.dtype).tiny
    return -torch.log((-torch.log(uniform.clamp(min=tiny))).clamp(min=tiny))


def check_noisy_gate_policy(noisy_gate_policy, k: int):
    """The policy as None/"Jitter"/"RSample" ("None" means None); ValueError otherwise."""
    policy = None if noisy_gate_policy in (None, "None") else noisy_gate_policy
    if policy not in NOISY_GATE_POLICIES:
        raise ValueError(
            f"noisy_gate_policy={noisy_gate_policy!r} is not supported; allowed values: None, "
            "'Jitter', 'RSample'"
        )
    if policy is not None and k != 1:
        raise ValueError(
            f"noisy_gate_policy={noisy_gate_policy!r} is for top-1 gating only, got k={k}; use "
            "noisy_gate_policy=None with k=2 (its second expert is sampled by "
            "top2_2nd_expert_sampling)"
        )
    return policy


class TopKGate(nn.Module):
    """Gate of an MoE layer: a bias-free fp32 projection to expert logits, then top-k routing."""

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group=None,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"k={k!r} is not supported; allowed values: 1, 2 (top-1, top-2)")
        self.wg = nn.Linear(model_dim, num_experts, bias=False).float()
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = check_noisy_gate_policy(noisy_gate_policy, k)
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.ep_group = ep_group
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group

    def forward(self, input: torch.Tensor, used_token: torch.Tensor | None = None) -> GateOutput:
        return self.route_input(input, used_token)

    def route_input(self, input: torch.Tensor, used_token: torch.Tensor | None = None):
        """The routing of ``input`` ``[tokens, model_dim]`` (what ``MOELayer`` calls, so that
        ``deepspeed.moe.sharded_moe.TopKGate`` can give ``forward`` DeepSpeed's tuple result)."""
        if used_token is not None:
            raise NotImplementedError("TopKGate: used_token is not supported by deepspeed_cpp")
        return self.route(self.gate_logits(input))

    def gate_logits(self, input: torch.Tensor) -> torch.Tensor:
        """fp32 expert logits ``[tokens, experts]`` of ``input`` (jittered in training under the
        'Jitter' policy)."""
        if self.wg.weight.dtype != torch.float32:
            self.wg = self.wg.float()  # the gate always runs in fp32, as DeepSpeed's
        input_fp32 = input.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            jitter = torch.empty_like(input_fp32).uniform_(
                1.0 - JITTER_EPSILON, 1.0 + JITTER_EPSILON
            )
            input_fp32 = input_fp32 * jitter
        return self.wg(input_fp32)

    def route(self, logits: torch.Tensor) -> GateOutput:
        """Routing of ``logits`` ``[tokens, experts]`` (fp32) in this gate's mode."""
        tokens, experts = logits.shape
        k = self.k
        noise = None
        if (k == 1 and self.noisy_gate_policy == "RSample" and self.training) or (
            k == 2 and self.top2_2nd_expert_sampling
        ):
            noise = gumbel_noise(logits.detach())
        priority = None
        if k == 1 and self.use_rts:
            priority = torch.rand(tokens, device=logits.device)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        capacity = capacity_for(tokens, experts, factor, self.min_capacity, k)
        routing = moe_gating(
            logits, k, capacity if self.drop_tokens else -1, noise=noise, priority=priority
        )
        exp_counts = routing.slot_counts.sum(0)
        if not self.drop_tokens:
            # Nothing is dropped: the buffer holds the busiest expert's tokens, the same on every
            # rank of the expert-parallel group so that the all-to-all splits agree.
            busiest = exp_counts.max() if exp_counts.numel() else exp_counts.new_zeros(())
            if self.ep_group is not None and dist.get_world_size(self.ep_group) > 1:
                with named_collective("all_reduce of the busiest expert's token count (MoE)"):
                    dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=self.ep_group)
            capacity = int(busiest)
        # Load-balancing loss: E * sum_e(mean gate prob_e * fraction of first choices_e); for
        # top-2 DeepSpeed writes it as mean(me * ce) * E^2, the same number.
        me = torch.softmax(logits, dim=1).mean(0)
        ce = routing.slot_counts[0].to(logits.dtype) / max(tokens, 1)
        l_aux = torch.sum(me * ce) * experts
        return GateOutput(l_aux, routing, capacity, exp_counts.detach().cpu())
