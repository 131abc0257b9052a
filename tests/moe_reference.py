"""Plain-torch MoE gating, written from DeepSpeed's top1gating/top2gating
(deepspeed/moe/sharded_moe.py) with dense one-hot masks and cumulative sums: the reference the
gating op and the MoE layer are checked against.

The noise (Gumbel samples) and the random-token-selection priorities are inputs, so that the op
and the reference see the same draws. Without priorities an expert's capacity goes to tokens in
token order (DeepSpeed's top-1 without RTS takes torch.topk of a 0/1 mask, whose order among the
ones torch does not specify; token order is what its top-2 does).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def capacity_for(tokens: int, experts: int, capacity_factor: float, min_capacity: int, k: int):
    """DeepSpeed's _capacity: ceil(tokens / experts * factor), at least min_capacity (top-2
    doubles the factor)."""
    capacity = math.ceil((tokens / experts) * (capacity_factor * k))
    return max(capacity, min_capacity)


def reference_gating(logits, k, capacity, noise=None, priority=None):
    """(expert [T,k], position [T,k] (-1 dropped), kept [T,k], weight [T,k], slot_counts [k,E],
    l_aux) as DeepSpeed computes them; capacity < 0 keeps every token."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    if k == 1:
        chooser = logits if noise is None else logits + noise
        mask1 = F.one_hot(torch.argmax(chooser, dim=1), experts)
        masks = [mask1]
    else:
        mask1 = F.one_hot(torch.argmax(gates, dim=1), experts)
        chooser = logits if noise is None else logits + noise
        second = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
        masks = [mask1, F.one_hot(second, experts)]
    slot_counts = torch.stack([m.sum(0) for m in masks])
    me = gates.mean(0)
    ce = mask1.to(logits.dtype).mean(0)
    l_aux = torch.mean(me * ce) * experts * experts

    if k == 1 and priority is not None:
        # Each expert keeps its `capacity` tokens of highest priority (stable: lower index first).
        kept_mask = torch.zeros_like(mask1)
        for e in range(experts):
            mine = torch.nonzero(mask1[:, e]).flatten()
            # Descending, as DeepSpeed's torch.topk: NaN first (above every number).
            order = torch.argsort(priority[mine].double(), descending=True, stable=True)
            chosen = mine[order] if capacity < 0 else mine[order[:capacity]]
            kept_mask[chosen, e] = 1
        locations = [torch.cumsum(kept_mask, 0) - 1]
        kept_masks = [kept_mask]
    else:
        locations = [torch.cumsum(m, 0) - 1 for m in masks]
        if k == 2:
            locations[1] = locations[1] + mask1.sum(0, keepdim=True)
        if capacity < 0:
            kept_masks = masks
        else:
            kept_masks = [m * (loc < capacity) for m, loc in zip(masks, locations)]

    expert = torch.stack([m.argmax(1) for m in masks], 1)
    kept = torch.stack([m.sum(1) > 0 for m in kept_masks], 1)
    position = torch.stack([(loc * m).sum(1) for loc, m in zip(locations, kept_masks)], 1)
    position = torch.where(kept, position, torch.full_like(position, -1))
    slot_gates = [torch.einsum("se,se->s", gates, m.to(gates.dtype)) for m in kept_masks]
    if k == 2:
        denom = torch.clamp(slot_gates[0] + slot_gates[1], min=torch.finfo(gates.dtype).eps)
        slot_gates = [g / denom for g in slot_gates]
    weight = torch.stack(slot_gates, 1)
    return expert, position, kept, weight, slot_counts, l_aux


def gumbel(shape, generator, dtype=torch.float32):
    """Gumbel(0, 1) samples from `generator` (DeepSpeed's gumbel_rsample, seeded)."""
    uniform = torch.rand(shape, generator=generator, dtype=dtype)
    tiny = torch.finfo(dtype).tiny
    return -torch.log((-torch.log(uniform.clamp(min=tiny))).clamp(min=tiny))
