"""DeepSpeed's ``deepspeed.moe.sharded_moe``: the gating functions with DeepSpeed's dense result
(``top1gating``, ``top2gating``, ``topkgating`` -> ``(l_aux, combine_weights, dispatch_mask,
exp_counts)`` with ``[tokens, experts, capacity]`` tensors, or the sparse routes with
``sparse_routes=True``), the sparse dispatch helpers, ``TopKGate`` and ``MOELayer``.

Top-1 and top-2 decide through the gating op (``torch.ops.deepspeed_cpp.moe_gating``, the one
``deepspeed.moe.layer.MoE`` runs), so a script calling these functions routes exactly as our MoE
layer does; the dense tensors are built from its per-(token, slot) decisions. Top-k for any k
(DeepSpeed's ``topkgating``, with its 'probs'/'position' drop policies) has no op and is written
with torch here.

``dist`` is ``deepspeed.comm``, looked up at call time: the busiest-expert all-reduce of
``drop_tokens=False`` goes through ``sharded_moe.dist.all_reduce``, as DeepSpeed's does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm as dist
from ..ops.moe import Gating, moe_gating
from . import gating as _gating
from .dispatch import _AllToAll
from .gating import capacity_for, gumbel_noise
from .layer import MOELayer as _MOELayer

__all__ = [
    "MOELayer",
    "TopKGate",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
    "_AllToAll",
    "_route_slots",
    "_sparse_decode",
    "_sparse_encode",
]

DROP_POLICIES = ("probs", "position")


def gumbel_rsample(shape, device) -> torch.Tensor:
    """Gumbel(0, 1) samples of ``shape`` on ``device``."""
    return gumbel_noise(torch.empty(shape, device=device))


def multiplicative_jitter(x: torch.Tensor, device=None, epsilon: float = 1e-2) -> torch.Tensor:
    """``x`` times uniform noise in [1 - epsilon, 1 + epsilon] (``epsilon == 0``: ``x``)."""
    if epsilon == 0:
        return x
    return x * torch.empty_like(x).uniform_(1.0 - epsilon, 1.0 + epsilon)


def _is_parallel(group) -> bool:
    return group is not None and dist.get_world_size(group=group) > 1


def _busiest_expert(exp_counts: torch.Tensor, ep_group) -> torch.Tensor:
    """Tokens of the busiest expert, agreed (max) over the expert-parallel group: the buffer
    size when nothing is dropped, the same on every rank so that the all-to-all splits agree."""
    busiest = exp_counts.max() if exp_counts.numel() else exp_counts.new_zeros(())
    if _is_parallel(ep_group):
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=ep_group)
    return busiest


def _check_logits(logits: torch.Tensor, who: str) -> None:
    if logits.dim() != 2:
        raise ValueError(
            f"{who}: logits must be [tokens, experts], got shape {tuple(logits.shape)}"
        )


def _dense(logits, routing: Gating, capacity: int):
    """``(combine_weights, dispatch_mask)`` ``[tokens, experts, capacity]`` of the op's routing."""
    tokens, experts = logits.shape
    kept = routing.kept
    token = torch.arange(tokens, device=logits.device).unsqueeze(1).expand_as(kept)
    combine = routing.weight.new_zeros((tokens, experts, capacity))
    combine = combine.index_put(
        (token[kept], routing.expert[kept], routing.position[kept]), routing.weight[kept]
    )
    return combine, combine.bool()


def _sparse(routing: Gating):
    """``(indices, locations, gates)`` ``[k, tokens]``: a dropped route has index -1, location 0
    and gate 0."""
    kept = routing.kept
    indices = torch.where(kept, routing.expert, torch.full_like(routing.expert, -1))
    locations = torch.where(kept, routing.position, torch.zeros_like(routing.position))
    gates = routing.weight * kept
    return (
        indices.t().contiguous().to(torch.int32),
        locations.t().contiguous().to(torch.int32),
        gates.t().contiguous(),
    )


def _op_gating(
    logits,
    k,
    capacity_factor,
    min_capacity,
    drop_tokens,
    ep_group,
    sparse_routes,
    noise=None,
    priority=None,
    cap_at_tokens=False,
):
    tokens, experts = logits.shape
    capacity = capacity_for(tokens, experts, capacity_factor, min_capacity, k)
    routing = moe_gating(logits, k, capacity if drop_tokens else -1, noise=noise, priority=priority)
    exp_counts = routing.slot_counts.sum(0)
    if not drop_tokens:
        capacity = int(_busiest_expert(exp_counts, ep_group))
        if cap_at_tokens:
            capacity = min(capacity, tokens)
    me = torch.softmax(logits, dim=1).mean(0)
    ce = routing.slot_counts[0].to(me.dtype) / max(tokens, 1)
    l_aux = torch.sum(me * ce) * experts
    if sparse_routes:
        return (l_aux, capacity, experts, *_sparse(routing), exp_counts)
    return (l_aux, *_dense(logits, routing, capacity), exp_counts)


def top1gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: torch.Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group=None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
):
    """Top-1 routing of ``logits`` ``[tokens, experts]``: each token to its most probable expert
    (with Gumbel noise under 'RSample'), at most ``capacity`` tokens an expert (random ones with
    ``use_rts``, else the first), capacity = max(ceil(tokens / experts * capacity_factor),
    min_capacity); ``drop_tokens=False``: the busiest expert's count over ``ep_group``, at most
    ``tokens``."""
    _check_logits(logits, "top1gating")
    if used_token is not None:
        raise NotImplementedError("top1gating: used_token is not supported by deepspeed_cpp")
    if noisy_gate_policy not in _gating.NOISY_GATE_POLICIES + ("None",):
        raise ValueError(
            f"top1gating: noisy_gate_policy={noisy_gate_policy!r} is not supported; allowed "
            "values: None, 'Jitter', 'RSample'"
        )
    if logits.shape[0] < min_capacity:
        raise ValueError(
            f"top1gating: {logits.shape[0]} tokens is fewer than min_capacity={min_capacity}; "
            "set min_capacity to 0 or route a larger batch"
        )
    noise = gumbel_noise(logits.detach()) if noisy_gate_policy == "RSample" else None
    priority = torch.rand(logits.shape[0], device=logits.device) if use_rts else None
    return _op_gating(
        logits,
        1,
        capacity_factor,
        min_capacity,
        drop_tokens,
        ep_group,
        sparse_routes,
        noise=noise,
        priority=priority,
        cap_at_tokens=True,
    )


def top2gating(
    logits: torch.Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
):
    """Top-2 routing: the most probable expert, then the next (chosen with Gumbel noise under
    ``top2_2nd_expert_sampling``); capacity = max(ceil(tokens / experts * 2 * capacity_factor),
    min_capacity), first choices fill it before second ones; the two weights are normalised
    over the kept routes."""
    _check_logits(logits, "top2gating")
    noise = gumbel_noise(logits.detach()) if top2_2nd_expert_sampling else None
    return _op_gating(
        logits, 2, capacity_factor, min_capacity, drop_tokens, ep_group, sparse_routes, noise=noise
    )


def topkgating(
    logits: torch.Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group=None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
):
    """Top-k routing for any ``k``: each token to its ``k`` most probable experts; capacity =
    max(ceil(tokens / experts * k * capacity_factor), min_capacity). Over capacity an expert
    keeps its most probable tokens (``drop_policy='probs'``) or its first ones ('position');
    the weights are the kept probabilities normalised per token."""
    _check_logits(logits, "topkgating")
    tokens, experts = logits.shape
    if not 1 <= k <= experts:
        raise ValueError(f"topkgating: k={k!r} must be in 1..{experts} (the number of experts)")
    if drop_tokens and drop_policy not in DROP_POLICIES:
        raise ValueError(
            f"topkgating: drop_policy={drop_policy!r} is not supported; allowed values: "
            f"{', '.join(map(repr, DROP_POLICIES))}"
        )
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    chosen = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = chosen.sum(0).detach()
    l_aux = torch.mean(gates.mean(0) * chosen.to(gates.dtype).mean(0)) * experts * experts / k
    mask = chosen
    if not drop_tokens:
        capacity = int(_busiest_expert(exp_counts, ep_group))
    else:
        capacity = capacity_for(tokens, experts, capacity_factor, min_capacity, k)
        if drop_policy == "probs":
            # Each expert keeps the min(capacity, tokens) tokens that gave it the highest
            # probability among those that chose it.
            chosen_gates = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            best = torch.topk(chosen_gates, k=min(capacity, tokens), dim=0, sorted=False)[1]
            mask = chosen & torch.zeros_like(chosen).scatter_(0, best, True)
        else:
            mask = chosen & (torch.cumsum(chosen, dim=0) - 1 < capacity)
    locations = torch.cumsum(mask, dim=0) - 1
    kept_gates = gates * mask
    kept_gates = kept_gates / kept_gates.sum(-1, keepdim=True).clamp(
        min=torch.finfo(kept_gates.dtype).eps
    )
    if sparse_routes:
        route_kept = mask.gather(1, top_idx)
        indices = torch.where(route_kept, top_idx, torch.full_like(top_idx, -1))
        route_locations = locations.gather(1, top_idx) * route_kept
        route_gates = kept_gates.gather(1, top_idx)
        return (
            l_aux,
            capacity,
            experts,
            indices.t().contiguous().to(torch.int32),
            route_locations.t().contiguous().to(torch.int32),
            route_gates.t().contiguous(),
            exp_counts,
        )
    location_one_hot = F.one_hot(locations * mask, num_classes=capacity).to(kept_gates.dtype)
    combine = kept_gates.unsqueeze(2) * location_one_hot
    return l_aux, combine, combine.bool(), exp_counts


def _route_slots(
    indices: torch.Tensor, locations: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """Flat slot ``expert * capacity + location`` of each route ``[k, tokens]``; dropped routes
    (index < 0) go to the spare slot ``num_experts * capacity``."""
    slot = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, slot, torch.full_like(slot, num_experts * capacity))


def _sparse_encode(
    tokens: torch.Tensor, slots: torch.Tensor, num_experts: int, capacity: int
) -> torch.Tensor:
    """``[tokens, M]`` -> the ``[experts, capacity, M]`` expert buffer (empty slots zero)."""
    num_tokens, d_model = tokens.shape
    # Which token fills each slot (num_tokens: none, a zero row); the spare slot is dropped.
    source = torch.full((num_experts * capacity + 1,), num_tokens, device=slots.device)
    token_of_route = torch.arange(num_tokens, device=slots.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_of_route.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, d_model)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, d_model)


def _sparse_decode(
    expert_output: torch.Tensor, slots: torch.Tensor, gates: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """``[experts * capacity, M]`` -> ``[tokens, M]``: each token's expert outputs weighted by
    its gates ``[k, tokens]`` (summed in the gates' dtype, fp32, then cast back)."""
    d_model = expert_output.shape[-1]
    padded = torch.cat([expert_output, expert_output.new_zeros(1, d_model)])
    routed = padded.index_select(0, slots.reshape(-1)).view(slots.shape[0], num_tokens, d_model)
    return (routed * gates.unsqueeze(-1)).sum(0).to(expert_output.dtype)


class TopKGate(_gating.TopKGate):
    """DeepSpeed's ``TopKGate``: ``gate(input)`` returns ``top1gating`` / ``top2gating``'s result
    (``(l_aux, combine_weights, dispatch_mask, exp_counts)``) for ``input`` ``[tokens, model_dim]``.
    Inside ``MOELayer`` it routes through the same op without building the dense tensors."""

    def forward(
        self,
        input: torch.Tensor,
        used_token: torch.Tensor | None = None,
        sparse_routes: bool = False,
        use_tutel: bool = False,
    ):
        logits = self.gate_logits(input)
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return top1gating(
                logits,
                factor,
                self.min_capacity,
                used_token,
                self.noisy_gate_policy if self.training else None,
                self.drop_tokens,
                self.use_rts,
                self.ep_group,
                sparse_routes,
            )
        return top2gating(
            logits,
            factor,
            self.min_capacity,
            self.drop_tokens,
            self.ep_group,
            self.top2_2nd_expert_sampling,
            sparse_routes,
        )


class MOELayer(_MOELayer):
    """DeepSpeed's ``MOELayer(gate, experts, ep_group_name, ep_size, num_local_experts,
    use_tutel=False)``; ``use_tutel`` is accepted and ignored (Tutel is not used)."""

    def __init__(
        self, gate, experts, ep_group_name, ep_size, num_local_experts, use_tutel: bool = False
    ):
        super().__init__(gate, experts, ep_group_name, ep_size, num_local_experts)
