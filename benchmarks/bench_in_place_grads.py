"""ZeRO 0 with several data-parallel replicas: gradients accumulated in place in the flat buffers
and all-reduced there (runtime/zero/in_place_grads.py) beside the reducer's path (gradients
copied into its buckets, all-reduced, added into the flat gradients), in one run.

Both engines live in the same processes (2 gloo ranks, 1 thread each) over equal models
(``--layers`` x Linear(``--width``) + ReLU), stepping in turn (the order alternating) so that the
load of a shared machine falls on both alike; printed: the median time of one optimizer step
(``--micro-steps`` forward+backward micro-steps and the step) of each, and the ratio.

    python benchmarks/bench_in_place_grads.py [--layers 8] [--width 1024] [--steps 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_ranks import run_on_ranks  # noqa: E402

IN_PLACE, REDUCER = "in place", "reducer"


def _engine(args, in_place: bool):
    import deepspeed_cpp as deepspeed

    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    engine, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-4),
        config={
            "train_micro_batch_size_per_gpu": args.micro_batch,
            "gradient_accumulation_steps": args.micro_steps,
            "zero_optimization": {"stage": 0},
            "steps_per_print": 10**9,
        },
    )
    if not in_place:
        engine.optimizer._in_place_grads = None  # the reducer's path
    return engine


def worker(rank: int, args) -> dict:
    torch.set_num_threads(args.threads)
    engines = {IN_PLACE: _engine(args, True), REDUCER: _engine(args, False)}
    assert engines[IN_PLACE].optimizer._in_place_grads is not None
    generator = torch.Generator().manual_seed(rank)
    data = [
        (torch.randn(args.micro_batch, args.width, generator=generator),
         torch.randn(args.micro_batch, args.width, generator=generator))
        for _ in range(args.micro_steps)
    ]  # fmt: skip
    samples: dict[str, list[float]] = {IN_PLACE: [], REDUCER: []}
    for step in range(2 + args.steps):
        order = [IN_PLACE, REDUCER] if step % 2 == 0 else [REDUCER, IN_PLACE]
        for name in order:
            engine = engines[name]
            dist.barrier()
            began = time.perf_counter()
            for x, y in data:
                engine.backward(torch.nn.functional.mse_loss(engine(x), y))
                engine.step()
            if step >= 2:
                samples[name].append(time.perf_counter() - began)
    return {name: statistics.median(times) for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--micro-steps", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    results = run_on_ranks(2, worker, args)
    slowest = {name: max(r[name] for r in results) for name in (REDUCER, IN_PLACE)}
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"ZeRO 0, 2 replicas (gloo, {args.threads} thread(s) each), {args.layers} x "
        f"Linear({args.width}) ({params / 1e6:.1f}M parameters), {args.micro_steps} micro-steps "
        f"of {args.micro_batch} per step; median of {args.steps} steps, slowest rank"
    )
    ratio = slowest[IN_PLACE] / slowest[REDUCER]
    print(f"step time (s): reducer {slowest[REDUCER]:.3f}  in place {slowest[IN_PLACE]:.3f}  "
          f"in place / reducer {ratio:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
