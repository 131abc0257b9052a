"""Pipeline parallelism: deepspeed_cpp's ``PipelineEngine`` beside DeepSpeed's, same model, same
schedule shape, in one run.

A 24-layer MLP (``Linear(width, width)`` + ``ReLU`` per layer) as a ``PipelineModule`` of 2
stages x 1 replica, 8 micro-batches per ``train_batch`` (1F1B), torch's Adam as the client
optimizer, fp32, 2 processes on gloo. Step times come from one launch holding both engines,
stepping in turn (the order alternating), ``--steps`` timed batches after 2 warm-up ones each, so
that the load of a shared machine falls on both alike.

Printed per stage: the median step time; the bubble, the fraction of the step the stage is not
computing (1 - time in its forward and backward passes / step time; both engines' pass functions
are wrapped by the same timer, so the split is measured the same way), beside 1F1B's ideal
(stages - 1) / (micro-batches + stages - 1); and the peak RSS of the stage's process
(``ru_maxrss``, with the RSS before the model was built beside it), one engine per launch.

    python benchmarks/bench_pipe.py [--deepspeed-path /work/ds_target] [--steps 8]

DeepSpeed runs with ``DS_ACCELERATOR=cpu`` when it can be imported from ``--deepspeed-path``
(prepended to ``sys.path`` in its rank processes only); otherwise its column says why.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gloo_ranks import run_on_ranks  # noqa: E402

OURS, DS = "deepspeed_cpp", "DeepSpeed"


def _rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _layers(pipe_module, args):
    torch.manual_seed(0)
    layers = []
    for _ in range(args.layers):
        layers += [pipe_module.LayerSpec(torch.nn.Linear, args.width, args.width), torch.nn.ReLU()]
    return layers


class PassTimer:
    """Wraps a forward/backward pass function, summing its seconds."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, function):
        def timed(*a, **k):
            began = time.perf_counter()
            try:
                return function(*a, **k)
            finally:
                self.seconds += time.perf_counter() - began

        return timed


def build(name: str, args, timer: PassTimer):
    """The engine of implementation ``name`` with its forward/backward passes timed."""
    if name == DS:
        if args.deepspeed_path:
            sys.path.insert(0, args.deepspeed_path)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import logging

        import deepspeed
        import deepspeed.pipe as pipe_module
        from deepspeed.runtime.pipe import engine as ds_engine
        from deepspeed.runtime.pipe import schedule as ds_schedule

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")  # adopts the group already made
        table = ds_engine.PipelineEngine._INSTRUCTION_MAP
        for kind in (ds_schedule.ForwardPass, ds_schedule.BackwardPass):
            table[kind] = timer.wrap(table[kind])
    else:
        import deepspeed_cpp as deepspeed
        import deepspeed_cpp.pipe as pipe_module
    model = pipe_module.PipelineModule(
        _layers(pipe_module, args),
        num_stages=2,
        loss_fn=torch.nn.MSELoss(),
        partition_method="uniform",
    )
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.micro_batches,
        "train_batch_size": args.micro_batch * args.micro_batches,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-4), config=config
    )
    if name == OURS:
        engine._exec_forward_pass = timer.wrap(engine._exec_forward_pass)
        engine._exec_backward_pass = timer.wrap(engine._exec_backward_pass)
    torch.set_num_threads(args.threads)
    return engine


def _batches(args):
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(args.micro_batch, args.width, generator=generator),
         torch.randn(args.micro_batch, args.width, generator=generator))
        for _ in range(args.micro_batches)
    ]  # fmt: skip


def _timed_step(engine, batches, timer: PassTimer) -> tuple[float, float]:
    dist.barrier()
    timer.seconds = 0.0
    began = time.perf_counter()
    engine.train_batch(iter(batches))
    return time.perf_counter() - began, timer.seconds


def timing_worker(rank: int, args) -> dict:
    """Both engines in these processes, one step of each per round (order alternating), so
    that the load of a shared machine falls on both alike."""
    torch.set_num_threads(args.threads)
    timers = {name: PassTimer() for name in (DS, OURS)}
    engines = {}
    for name in (DS, OURS):
        try:
            engines[name] = build(name, args, timers[name])
        except Exception as error:  # noqa: BLE001 - reported in the table
            if name == OURS:
                raise
            engines[DS] = f"{type(error).__name__}: {error}"
    batches = _batches(args)
    runs = [n for n in (DS, OURS) if not isinstance(engines[n], str)]
    samples: dict[str, list] = {name: [] for name in runs}
    for step in range(2 + args.steps):
        for name in runs if step % 2 == 0 else runs[::-1]:
            seconds, busy = _timed_step(engines[name], batches, timers[name])
            if step >= 2:
                samples[name].append((seconds, busy))
    out = {}
    for name in runs:
        times = [s for s, _ in samples[name]]
        out[name] = {
            "step": statistics.median(times),
            "bubble": statistics.median(1 - b / s for s, b in samples[name]),
        }
    if isinstance(engines[DS], str):
        out["note"] = engines[DS]
    return out


def memory_worker(rank: int, name: str, args) -> dict:
    """One engine per launch: its process's peak RSS over set-up and ``--steps`` steps."""
    torch.set_num_threads(args.threads)
    start = _rss_mib()
    timer = PassTimer()
    engine = build(name, args, timer)
    batches = _batches(args)
    for _ in range(2):
        _timed_step(engine, batches, timer)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"peak": peak, "start": start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deepspeed-path", default="/work/ds_target")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    timing = run_on_ranks(2, timing_worker, args)
    memory, notes = {}, {}
    for name in (DS, OURS):
        try:
            memory[name] = run_on_ranks(2, memory_worker, name, args)
        except RuntimeError as error:
            notes[name] = str(error).strip().splitlines()[-1]
    stages = 2
    ideal = (stages - 1) / (args.micro_batches + stages - 1)
    params = args.layers * (args.width * args.width + args.width)
    print(
        f"pipeline: {args.layers} x Linear({args.width}) + ReLU ({params / 1e6:.1f}M parameters), "
        f"2 stages x 1 replica, {args.micro_batches} micro-batches of {args.micro_batch}, fp32, "
        f"gloo, {args.threads} thread(s) per rank; median of {args.steps} steps, the two engines "
        "stepping in turn in the same processes"
    )
    print(f"{'metric':34s} {DS:>14s} {OURS:>14s} {'ours/DS':>9s}")

    def row(label: str, values: dict, fmt: str) -> None:
        ds, ours = values.get(DS), values.get(OURS)
        shown = [format(v, fmt) if v is not None else "n/a" for v in (ds, ours)]
        rel = f"{ours / ds:.2f}x" if ds and ours is not None else ""
        print(f"{label:34s} {shown[0]:>14s} {shown[1]:>14s} {rel:>9s}")

    def pick(per_rank: list, key: str, rank: int | None = None) -> dict:
        names = [n for n in (DS, OURS) if n in per_rank[0]]
        if rank is None:
            return {n: max(r[n][key] for r in per_rank) for n in names}
        return {n: per_rank[rank][n][key] for n in names}

    row("step time (s), slowest stage", pick(timing, "step"), ".3f")
    for stage in range(stages):
        row(f"bubble stage {stage} (ideal {ideal:.3f})", pick(timing, "bubble", stage), ".3f")
    for stage in range(stages):
        row(f"peak RSS stage {stage} (MiB)",
            {n: m[stage]["peak"] for n, m in memory.items()}, ".0f")  # fmt: skip
        row(f"  RSS at start stage {stage} (MiB)",
            {n: m[stage]["start"] for n, m in memory.items()}, ".0f")  # fmt: skip
    if "note" in timing[0]:
        notes[DS] = timing[0]["note"]
    for name, note in notes.items():
        print(f"{name} did not run: {note}")
    print("target: step time <= 0.9x DeepSpeed's")


if __name__ == "__main__":
    main()
