"""Jobs for tests/test_sharded_moe.py, run on every rank of a gloo pool (tests/dist_pool.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def no_drop_capacity_is_the_group_maximum(seed: int) -> list:
    """Each gating function with drop_tokens=False over a two-rank ep_group: the capacity of
    every rank is the busiest expert's count over both ranks (rank 1 has 5x the tokens)."""
    from deepspeed_cpp.moe.sharded_moe import top1gating, top2gating, topkgating

    rank = dist.get_rank()
    group = dist.new_group([0, 1])
    generator = torch.Generator().manual_seed(seed + rank)
    logits = torch.randn(6 * (1 + 4 * rank), 4, generator=generator, dtype=torch.float64)
    results = []
    for name, call in (
        (
            "top1",
            lambda: top1gating(logits, 1.0, 0, drop_tokens=False, use_rts=False, ep_group=group),
        ),
        (
            "top2",
            lambda: top2gating(
                logits, 1.0, 0, drop_tokens=False, ep_group=group, top2_2nd_expert_sampling=False
            ),
        ),
        ("top3", lambda: topkgating(logits, 3, 1.0, 0, drop_tokens=False, ep_group=group)),
    ):
        _, combine, _, exp_counts = call()
        local = int(exp_counts.max())
        everyone = torch.tensor([local])
        dist.all_reduce(everyone, op=dist.ReduceOp.MAX)
        routes = int(combine.bool().sum())
        results.append((name, combine.shape[-1], local, int(everyone), routes, logits.shape[0]))
    return results
