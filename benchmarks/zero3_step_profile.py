"""ZeRO-3 step time against our ZeRO-2, interleaved in the same processes, with a breakdown.

``bench_zero3.py --parts table`` runs each implementation in processes of its own, one after
the other: on the shared 2-core machine the load changes between launches by more than the
differences sought. Here both engines live in the same 2 gloo processes (a model each, same
initial weights and batches) and take turns, one step each per round, so the machine's noise
hits both alike; the median of the rounds after a warm-up is printed with the ratio.

``--breakdown`` also times, per step and rank, the ZeRO-3 coordinator's hooks, the gathers, the
gradient hand-over, the end of backward and the optimizer step (wall-clock wrappers around
those functions, inclusive), and Python's garbage collections by generation (``gc.callbacks``):
the measurements behind the per-unit changes of issue 27.

    python benchmarks/zero3_step_profile.py [--model deep|transformer] [--rounds 20]
        [--breakdown] [--whole-layers] [--prefetch 5e6]

``--whole-layers`` lifts the prefetch-bucket cap on repeated blocks (each transformer layer one
unit whole, whatever ``stage3_prefetch_bucket_size``), for the comparison in coordinator.py.

Measured 2026-11-27 18:31-18:33 (issue 27, branch s5-zero3-step; Intel Xeon, 2 cores shared
with ~7 other jobs, load average 23: wall times vary several-fold between minutes, the CPU time
per step does not), deep model, 20 rounds, main then the branch back to back:

    checkout  ZeRO-2 CPU ms  ZeRO-3 CPU ms  ratio  ZeRO-3 main thread  wall-median ratio
    main               52.5           96.6   1.84                77.9               2.04
    branch             50.7           73.4   1.45                55.8               1.66

On main, register_multi_grad_hook on each unit's outputs kept ~15 objects per unit alive from
the forward to the backward: one garbage collection per step, and a full (generation 2) one
every ~10-60 steps at 0.3-2 s each over the ~340K objects of a process with torch loaded.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_zero import SEQ, VOCAB, lm_loss  # noqa: E402
from bench_zero import make_model as make_transformer  # noqa: E402
from bench_zero3_collectives import make_model as make_small_model  # noqa: E402
from gloo_ranks import run_on_ranks  # noqa: E402

TIMED = {
    "coordinator": ("_pre_forward", "_post_forward", "_pre_backward", "_after_accumulate",
                    "fetch", "done", "end_pass"),
    "gather": ("launch", "finish"),
    "optimizer": ("_hand_over", "end_backward", "_global_norm", "_step_and_gather"),
}  # fmt: skip


class Breakdown:
    """Inclusive wall-clock seconds and calls per wrapped function, and per gc generation."""

    def __init__(self):
        self.seconds: dict[str, list] = {}
        self.on = False

    def wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if not self.on:
                return original(*args, **kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(label, time.perf_counter() - start)

        setattr(owner, name, timed)

    def add(self, label: str, seconds: float) -> None:
        entry = self.seconds.setdefault(label, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1

    def install(self) -> None:
        from deepspeed_cpp.runtime.zero import coordinator, partitioned_optimizer, unit

        owners = {
            "coordinator": coordinator.ParameterCoordinator,
            "gather": unit._FlatGather,
            "optimizer": partitioned_optimizer.ZeroPartitionedOptimizer,
        }
        for kind, names in TIMED.items():
            for name in names:
                self.wrap(owners[kind], name, f"{kind}.{name}")
        started = {}

        def collections(phase, info):
            if phase == "start":
                started["at"] = time.perf_counter()
            elif self.on:
                self.add(f"gc generation {info['generation']}", time.perf_counter() - started["at"])

        gc.callbacks.append(collections)


def build(stage: int, model_name: str, whole_layers: bool, prefetch: float):
    import deepspeed_cpp

    if model_name == "deep":
        model = make_small_model("deep")
    else:
        model = make_transformer(8, 704, VOCAB, 0)
    zero = {"stage": stage, "reduce_bucket_size": 5_000_000}
    if stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": int(prefetch),
            "stage3_param_persistence_threshold": 0 if model_name == "deep" else 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
        })  # fmt: skip
        if whole_layers:
            from deepspeed_cpp.runtime.zero import coordinator

            capped = coordinator._repeated_blocks
            coordinator._repeated_blocks = lambda c, m, cap: capped(c, m, 1 << 62)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed_cpp.initialize(model=model, config=config)
    return engine


def worker(rank: int, args) -> dict:
    torch.set_num_threads(1)
    breakdown = Breakdown()
    if args.breakdown:
        breakdown.install()
    engines = {s: build(s, args.model, args.whole_layers, args.prefetch) for s in (2, 3)}
    generator = torch.Generator().manual_seed(100 + rank)
    times: dict[int, list[float]] = {2: [], 3: []}
    cpu: dict[int, list[float]] = {2: [], 3: []}
    thread: dict[int, list[float]] = {2: [], 3: []}
    for round_index in range(args.warmup + args.rounds):
        if args.model == "deep":
            batch = torch.randn(32, 256, generator=generator)
        else:
            batch = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
        for stage, engine in engines.items():
            dist.barrier()
            measured = round_index >= args.warmup
            breakdown.on = measured and stage == 3
            start, cpu_start = time.perf_counter(), time.process_time()
            thread_start = time.thread_time()
            output = engine(batch)
            loss = output.square().mean() if args.model == "deep" else lm_loss(output, batch)
            engine.backward(loss)
            engine.step()
            if measured:
                times[stage].append(time.perf_counter() - start)
                cpu[stage].append(time.process_time() - cpu_start)
                thread[stage].append(time.thread_time() - thread_start)
            breakdown.on = False
    return {
        "step": {stage: statistics.median(values) for stage, values in times.items()},
        "mean": {stage: statistics.fmean(values) for stage, values in times.items()},
        "cpu": {stage: statistics.median(values) for stage, values in cpu.items()},
        "thread": {stage: statistics.median(values) for stage, values in thread.items()},
        "breakdown": {k: (v[0] / args.rounds, v[1] / args.rounds)
                      for k, v in breakdown.seconds.items()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("deep", "transformer"), default="deep")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--whole-layers", action="store_true")
    parser.add_argument("--prefetch", type=float, default=5e6, help="stage3_prefetch_bucket_size")
    args = parser.parse_args()
    ranks = run_on_ranks(2, worker, args)

    def slowest(key, stage):  # a step is as slow as its slowest rank
        return max(r[key][stage] for r in ranks)

    zero2, zero3 = slowest("step", 2), slowest("step", 3)
    units = (", whole-layer units" if args.whole_layers else "") + f", prefetch {args.prefetch:g}"
    print(f"{args.model} model, 2 gloo ranks x 1 thread, median of {args.rounds} interleaved "
          f"rounds after {args.warmup}{units}")  # fmt: skip
    # CPU: the process's CPU time per step, all its threads (the work, whatever the load).
    print(f"{'':22} {'median ms':>10} {'mean ms':>8} {'CPU ms':>7} {'main thread':>11}")
    for stage in (2, 3):
        print(f"deepspeed_cpp ZeRO-{stage}   {slowest('step', stage) * 1e3:10.1f} "
              f"{slowest('mean', stage) * 1e3:8.1f} {slowest('cpu', stage) * 1e3:7.1f} "
              f"{slowest('thread', stage) * 1e3:11.1f}")  # fmt: skip
    print(f"ZeRO-3 / ZeRO-2        {zero3 / zero2:10.2f} "
          f"{slowest('mean', 3) / slowest('mean', 2):8.2f} "
          f"{slowest('cpu', 3) / slowest('cpu', 2):7.2f}")  # fmt: skip
    if args.breakdown:
        print("  ZeRO-3 per step (rank 0 / rank 1, inclusive ms; calls):")
        for label in sorted(ranks[0]["breakdown"]):
            cells = [r["breakdown"].get(label, (0.0, 0)) for r in ranks]
            print(f"    {label:34} {cells[0][0] * 1e3:8.2f} / {cells[1][0] * 1e3:8.2f}"
                  f"   {cells[0][1]:6.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
