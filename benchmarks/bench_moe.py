"""Mixture of Experts: the gating op against DeepSpeed's dense top-k gating written in plain
torch, and one MoE layer (forward + backward) against DeepSpeed's dense einsum formulation, on
one process; and the layer with ep_size=2 on 2 gloo processes (each with half the experts and
its own tokens).

The torch reference is DeepSpeed's algorithm (one-hot masks, cumsum, [tokens, experts, capacity]
combine weights, einsum dispatch and combine); ours is the gating op plus indexed dispatch and
combine. Times are medians over the repetitions; tokens/s counts every rank's tokens.

    python benchmarks/bench_moe.py [--tokens 16384] [--hidden 1024] [--experts 8] [--k 2]
                                   [--repeats 5] [--threads N] [--device cuda]

With ``--device cuda`` the gating op and the layer run on the GPU (CUDA-synchronised timing) and
the 2-process gloo part is left out.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from gloo_ranks import run_on_ranks
from torch import nn

from deepspeed_cpp.moe.gating import capacity_for
from deepspeed_cpp.moe.layer import MoE
from deepspeed_cpp.ops.moe import load_moe, moe_gating


def torch_gating(logits, k, capacity):
    """DeepSpeed's top1gating/top2gating (no noise, no RTS): dense [S, E, C] combine weights."""
    tokens, experts = logits.shape
    gates = F.softmax(logits, dim=1)
    mask1 = F.one_hot(torch.argmax(gates, dim=1), experts)
    masks = [mask1]
    if k == 2:
        masks.append(F.one_hot(torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), 1),
                               experts))  # fmt: skip
    locations = [torch.cumsum(m, 0) - 1 for m in masks]
    if k == 2:
        locations[1] = locations[1] + mask1.sum(0, keepdim=True)
    masks = [m * (loc < capacity) for m, loc in zip(masks, locations)]
    slot_gates = [(gates * m).sum(1) for m in masks]
    if k == 2:
        denom = torch.clamp(slot_gates[0] + slot_gates[1], min=torch.finfo(gates.dtype).eps)
        slot_gates = [g / denom for g in slot_gates]
    combine = 0
    for g, m, loc in zip(slot_gates, masks, locations):
        location = F.one_hot((loc * m).sum(1), capacity).to(gates.dtype)
        combine = combine + torch.einsum("se,sc->sec", g.unsqueeze(1) * m, location)
    return combine


def torch_moe(moe: MoE, hidden: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's MOELayer forward on ``moe``'s weights (top-k, no noise), densely."""
    layer = moe.deepspeed_moe
    logits = F.linear(hidden.float(), layer.gate.wg.weight)
    tokens, experts = logits.shape
    capacity = capacity_for(tokens, experts, layer.gate.capacity_factor, layer.gate.min_capacity,
                            layer.gate.k)  # fmt: skip
    combine = torch_gating(logits, layer.gate.k, capacity)
    dispatched = torch.einsum("sec,sm->ecm", combine.bool().type_as(hidden), hidden)
    outputs = torch.stack([e(dispatched[i]) for i, e in enumerate(layer.experts.deepspeed_experts)])
    return torch.einsum("sec,ecm->sm", combine.type_as(hidden), outputs)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_time(function, repeats: int) -> float:
    function()  # warm-up
    times = []
    for _ in range(repeats):
        _synchronize()
        start = time.perf_counter()
        function()
        _synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_moe(args, ep_size: int) -> MoE:
    expert = nn.Linear(args.hidden, args.hidden)
    return MoE(args.hidden, expert, num_experts=args.experts, ep_size=ep_size, k=args.k,
               use_rts=False, top2_2nd_expert_sampling=False)  # fmt: skip


def layer_step(moe_forward, hidden):
    x = hidden.clone().requires_grad_(True)
    out = moe_forward(x)
    out = out[0] if isinstance(out, tuple) else out
    out.square().mean().backward()


def expert_parallel_worker(rank: int, args) -> float:
    torch.set_num_threads(max(1, args.threads // 2))
    torch.manual_seed(rank)
    moe = make_moe(args, ep_size=2)
    hidden = torch.randn(args.tokens // 2, args.hidden)
    return median_time(lambda: layer_step(moe, hidden), args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    load_moe()
    torch.manual_seed(0)

    logits = torch.randn(args.tokens, args.experts, device=device)
    capacity = capacity_for(args.tokens, args.experts, 1.0, 4, args.k)
    ours = median_time(lambda: moe_gating(logits, args.k, capacity), args.repeats)
    theirs = median_time(lambda: torch_gating(logits, args.k, capacity), args.repeats)
    print(f"gating, {args.tokens} tokens x {args.experts} experts, top-{args.k}, "
          f"capacity {capacity}, on {device} ({args.threads} CPU threads)")  # fmt: skip
    print(f"  {'':<22}{'ms':>10}")
    print(f"  {'torch (DeepSpeed)':<22}{theirs * 1e3:>10.2f}")
    print(f"  {'deepspeed_cpp op':<22}{ours * 1e3:>10.2f}   {theirs / ours:.1f}x")

    moe = make_moe(args, ep_size=1).to(device)
    reference = copy.deepcopy(moe)
    hidden = torch.randn(args.tokens, args.hidden, device=device)
    ours = median_time(lambda: layer_step(moe, hidden), args.repeats)
    theirs = median_time(lambda: layer_step(lambda x: torch_moe(reference, x), hidden),
                         args.repeats)  # fmt: skip
    print(f"\nMoE layer forward + backward, hidden {args.hidden}, {args.experts} experts "
          f"(Linear), top-{args.k}, {args.tokens} tokens")  # fmt: skip
    print(f"  {'':<22}{'tokens/s':>12}")
    print(f"  {'torch (DeepSpeed)':<22}{args.tokens / theirs:>12.0f}")
    print(f"  {'deepspeed_cpp':<22}{args.tokens / ours:>12.0f}   {theirs / ours:.2f}x")
    if device.type != "cpu":
        return
    times = run_on_ranks(2, expert_parallel_worker, args)
    print(f"  {'deepspeed_cpp ep_size=2':<22}{args.tokens / max(times):>12.0f}   "
          f"(2 processes, {args.tokens // 2} tokens each, {max(1, args.threads // 2)} threads "
          "each)")  # fmt: skip


if __name__ == "__main__":
    main()
