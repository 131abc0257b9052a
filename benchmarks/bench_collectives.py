"""The backend's reduce-scatter and all-gather against the compositions ZeRO uses on gloo.

ZeRO stages 1/2 reduce gradients bucket by bucket and all-gather updated parameters the same way.
On gloo, `csrc/zero` reduces with all-reduce and keeps the rank's slice, and
`deepspeed_cpp/runtime/zero/shard_gather.py` gathers with one all-to-all between 2 ranks and one
broadcast per rank among more. This script
times both against gloo's own collectives on the same buckets, all launched asynchronously and
then waited, as the engine does:

    python benchmarks/bench_collectives.py [--procs 2] [--elements 48e6] [--bucket 6e6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks


def worker(rank: int, args):
    torch.set_num_threads(1)
    world = args.procs
    bucket = int(args.bucket) // world * world
    total = int(args.elements) // bucket * bucket
    full = torch.randn(total)
    gathered = torch.empty(total)
    shards = torch.randn(total // world)
    starts = range(0, total, bucket)

    def each_bucket(launch):
        works = []
        for start in starts:
            works += launch(start)
        for work in works:
            work.wait()

    def shard_of(start):
        return shards.narrow(0, start // world, bucket // world)

    def reduce_scatter(start):
        return [
            dist.reduce_scatter_single(
                shard_of(start), full.narrow(0, start, bucket), async_op=True
            )
        ]

    def all_reduce_then_slice(start):
        return [dist.all_reduce(full.narrow(0, start, bucket), async_op=True)]

    def all_gather(start):
        return [
            dist.all_gather_single(
                gathered.narrow(0, start, bucket), shard_of(start), async_op=True
            )
        ]

    def broadcast_per_rank(start):
        size = bucket // world
        gathered.narrow(0, start + rank * size, size).copy_(shard_of(start))
        return [
            dist.broadcast(gathered.narrow(0, start + r * size, size), group_src=r, async_op=True)
            for r in range(world)
        ]

    def all_to_all_pair(start):
        """2 ranks: each sends its shard to the other (nothing to itself), received in place."""
        size, other = bucket // world, 1 - rank
        own = gathered.narrow(0, start + rank * size, size)
        own.copy_(shard_of(start))
        splits = [0, 0]
        splits[other] = size
        received = gathered.narrow(0, start + other * size, size)
        return [
            dist.all_to_all_single(
                received, own, output_split_sizes=splits, input_split_sizes=splits,
                async_op=True,
            )
        ]  # fmt: skip

    timings = {}
    launches = [
        ("reduce-scatter: gloo reduce_scatter", reduce_scatter),
        ("reduce-scatter: all_reduce + slice", all_reduce_then_slice),
        ("all-gather: gloo all_gather", all_gather),
        ("all-gather: broadcast per rank", broadcast_per_rank),
    ]
    if world == 2:
        launches.append(("all-gather: all-to-all of the pair", all_to_all_pair))
    for name, launch in launches:
        times = []
        for repeat in range(args.warmup + args.repeats):
            dist.barrier()
            start = time.perf_counter()
            each_bucket(launch)
            elapsed = time.perf_counter() - start
            if repeat >= args.warmup:
                times.append(elapsed)
        timings[name] = statistics.median(times)
    return rank, timings, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--elements", type=float, default=48e6, help="fp32 elements in all")
    parser.add_argument("--bucket", type=float, default=6e6, help="elements per bucket")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    reports = run_on_ranks(args.procs, worker, args)
    total = reports[0][2]
    print(f"{args.procs} processes (gloo, CPU), {total / 1e6:.1f}M fp32 elements in buckets of "
          f"{args.bucket / 1e6:.1f}M, median of {args.repeats}; slowest rank")  # fmt: skip
    seconds = {name: max(r[1][name] for r in reports) for name in reports[0][1]}
    for operation in ("reduce-scatter", "all-gather"):
        (ref_name, reference), *ours = [
            (name, value) for name, value in seconds.items() if name.startswith(operation)
        ]
        print(f"{ref_name:<40} {reference * 1e3:8.1f} ms")
        for ours_name, value in ours:
            print(f"{ours_name:<40} {value * 1e3:8.1f} ms   {reference / value:5.2f}x faster")


if __name__ == "__main__":
    main()
