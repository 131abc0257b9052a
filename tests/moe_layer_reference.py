"""DeepSpeed's MOELayer forward written out in plain torch with dense one-hot tensors and einsum
(as deepspeed/moe/sharded_moe.py computes it), reading the weights of one of our MoE layers:
the reference for the layer tests. Random draws are taken in the order our gate takes them
(jitter, Gumbel noise, token priorities) from torch's default generator."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from moe_reference import capacity_for, reference_gating


def _gumbel_like(logits):
    uniform = torch.rand_like(logits)
    tiny = torch.finfo(logits.dtype).tiny
    return -torch.log((-torch.log(uniform.clamp(min=tiny))).clamp(min=tiny))


def reference_moe_forward(moe, hidden, experts=None):
    """(output, l_aux, exp_counts) of ``moe`` (ep_size 1) on ``hidden``, computed densely.
    ``experts``: the expert modules in global order (default: the layer's own)."""
    layer = moe.deepspeed_moe
    gate = layer.gate
    experts = list(layer.experts.deepspeed_experts) if experts is None else experts
    d_model = hidden.shape[-1]
    tokens = hidden.reshape(-1, d_model)
    x = tokens.float()
    if gate.noisy_gate_policy == "Jitter" and gate.training:
        x = x * torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
    logits = F.linear(x, gate.wg.weight)
    num_tokens, num_experts = logits.shape
    k = gate.k
    noise = None
    if (k == 1 and gate.noisy_gate_policy == "RSample" and gate.training) or (
        k == 2 and gate.top2_2nd_expert_sampling
    ):
        noise = _gumbel_like(logits.detach())
    priority = torch.rand(num_tokens) if k == 1 and gate.use_rts else None
    factor = gate.capacity_factor if gate.training else gate.eval_capacity_factor
    capacity = capacity_for(num_tokens, num_experts, factor, gate.min_capacity, k)
    if not gate.drop_tokens:
        capacity = -1
    expert, position, kept, weight, slot_counts, l_aux = reference_gating(
        logits, k, capacity, noise, priority
    )
    exp_counts = slot_counts.sum(0)
    if capacity < 0:
        capacity = int(exp_counts.max())
    # combine_weights [S, E, C] = sum over slots of weight * onehot(expert) x onehot(position)
    combine = torch.zeros(num_tokens, num_experts, capacity, dtype=logits.dtype)
    for slot in range(k):
        # (one extra class so that a capacity of 0 has a one-hot at all; cut off after)
        location = F.one_hot(position[:, slot].clamp(min=0), capacity + 1)[:, :capacity]
        location = location.to(logits.dtype)
        location = location * kept[:, slot : slot + 1]
        per_expert = F.one_hot(expert[:, slot], num_experts).to(logits.dtype)
        combine = combine + torch.einsum(
            "se,sc->sec", per_expert * weight[:, slot : slot + 1], location
        )
    dispatch_mask = torch.zeros_like(combine)
    for slot in range(k):
        rows = torch.nonzero(kept[:, slot]).flatten()
        dispatch_mask[rows, expert[rows, slot], position[rows, slot]] = 1.0
    dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.type_as(hidden), tokens)
    expert_output = torch.stack([experts[e](dispatched[e]) for e in range(num_experts)])
    combined = torch.einsum("sec,ecm->sm", combine.type_as(hidden), expert_output)
    output = combined.reshape(hidden.shape)
    if moe.use_residual:
        mlp_out = moe.mlp(hidden)
        coef = F.softmax(moe.coefficient(hidden), dim=-1)
        output = output * coef[..., 0:1] + mlp_out * coef[..., 1:]
    return output, l_aux, exp_counts
