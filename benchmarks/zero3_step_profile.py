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
        [--breakdown] [--whole-layers] [--timeline] [--prefetch 5e6]
        [--probe keep-storage|no-copy-out|landed] [--persistence N] [--cprofile]

Each phase's minor page faults are counted too (the largest rank's median): pages written for the
first time, as by a buffer allocated afresh. ``--cprofile`` profiles rank 0's main thread over each
engine's measured steps (one profiler per engine) and prints the functions with the most own and
inclusive time: where a ZeRO-3 step's extra Python goes, next to ZeRO-2's. The breakdown's optimizer
rows cover ZeRO-2 too (the gradient hand-over and its reductions are the same code at both stages).

``--probe`` (timing only: what a change would gain, not a mode to train with) patches the ZeRO-3
gathers in these processes: ``keep-storage`` keeps each parameter's whole storage between
gathers instead of emptying it on release; ``no-copy-out`` also skips the copy-out of every
gather after a unit's first, so the parameters keep their first gathered values (as if the
gathered buffer were the parameters themselves). Measured (issue 27, 2026-11-28 10:24 UTC,
transformer, 8 rounds, each twice, ``benchmarks/results/zero3_step_s10.txt``): ZeRO-3/ZeRO-2
1.08 / 1.06 without a probe, 1.13 / 1.11 with ``keep-storage``, 1.06 / 1.06 with
``no-copy-out`` (a kept storage was then resized to its own size, which in torch's CPU resize
allocates anew and copies). Redone with the probe handing a kept storage back as it is (12:24,
``benchmarks/results/zero3_step_s11.txt``): 1.06 / 1.05 without, 1.04 / 1.08 ``keep-storage``,
1.01 / 1.06 ``no-copy-out``: within this machine's noise.

Two bounds on what a faster ZeRO-3 could reach (issue 27, seventeenth session): ``--probe landed``
sleeps 15 ms right after launching each unit gather (a collective every rank reaches at the same
point), so the exchange has landed before it is waited for, and takes what it slept out of the
step and phase times (the breakdown, the timeline and cProfile still include the sleeps): what is
left is the step without the exchange's wait, the most that overlapping the exchange with earlier
work (the previous step's update) could win, if that work left the exchange's threads a core as
the sleep does. ``--persistence N`` sets the deep model's
``stage3_param_persistence_threshold`` (default 0): with 100000 every parameter persists, nothing
is gathered, and what is left of the gap is the hooks alone. Measured (2026-11-29, AMD EPYC, 2
cores, deep model, 15 rounds, the four forms in turn three times,
``benchmarks/results/zero3_step_s17.txt``), ZeRO-3/ZeRO-2 at 07:29-07:31 UTC: 1.31 / 1.36 / 1.39 as
it is, 1.14 / 1.19 / 1.25 with ``--probe landed``, 1.24 / 1.29 / 1.25 with ``--persistence 300``
(the weights alone gathered), 1.07 / 0.98 / 1.12 with ``--persistence 100000``; at 06:18-06:20, the
machine ~40 % faster and the probe then sleeping after gathers of several parameters only: 1.38 /
1.39 / 1.41, 1.18 / 1.18 / 1.20 (the forward 27-28 ms -> 20-21 ms), 1.20 / 1.28 / 1.26, 1.05 /
1.06 / 1.05. So waiting for the exchange is about half of the gap, the gathers' own CPU work
(launch, copy-out, release) most of the rest, and the hooks ~5 %.

``--whole-layers`` adds a third engine in the same processes, taking its turn in each round: ZeRO-3
with the block cap lifted (each transformer layer one unit whole, whatever
``stage3_prefetch_bucket_size``), for the comparison in coordinator.py. ``--timeline`` prints,
per ZeRO-3 engine, rank 0's fetches and gathers (start, end) in the last measured step.
Since the cap follows ``stage3_max_live_parameters`` alone, the 50M transformer's layers are
whole units by default and ``--whole-layers`` changes nothing there. Measured before that change
(issue 27, branch s5-layers, 2026-11-27, transformer, 5e6 prefetch bucket, ZeRO-3 per module vs
whole layers in the same processes; per step, slowest rank; blocked: gather.finish rank 0 / 1):

    run (load avg)        rounds  median ms      CPU ms         blocked on gathers ms
    19:10 (16)               6    4489 / 4867    1319 / 1340    1005/735 vs 848/843
    19:14 (3-13)             8    1742 / 1694    1216 / 1221    137/115 vs 209/193

Measured 2026-11-27 18:31-18:33 (issue 27, branch s5-zero3-step; Intel Xeon, 2 cores shared
with ~7 other jobs, load average 23: wall times vary several-fold between minutes, the CPU time
per step does not), deep model, 20 rounds, main then the branch back to back:

    checkout  ZeRO-2 CPU ms  ZeRO-3 CPU ms  ratio  ZeRO-3 main thread  wall-median ratio
    main               52.5           96.6   1.84                77.9               2.04
    branch             50.7           73.4   1.45                55.8               1.66

On main, register_multi_grad_hook on each unit's outputs kept ~15 objects per unit alive from
the forward to the backward: one garbage collection per step, and a full (generation 2) one
every ~10-60 steps at 0.3-2 s each over the ~340K objects of a process with torch loaded.

Then (issue 27, branch s6-zero3-step, 2026-11-27 20:50-21:44, Intel Xeon, 2 cores shared with
other jobs at load average 17-43): a cProfile of rank 0's main thread (thread CPU time, deep
model, 20 steps) put ZeRO-3's extra over ZeRO-2 in the forward (the fetches: gathers, copy-out,
schedule calls), the gradient hooks (two Python hooks per parameter), the releases and the
optimizer's per-tensor step counters (194 tensors). Changed: one hook per parameter (the
coordinator hands the gradient to the reducer), fewer schedule calls per use, a cheaper
release, one foreach op for the step counters, and gather buffers kept between gathers
(``gather_buffers.py``: the transformer's 47.6 MB receive buffers were fresh mappings,
page-faulting on every gather). Main (839b0d1) then the branch, back to back:

    model        rounds  checkout  median ratio  mean ratio  CPU ratio  ZeRO-3 CPU ms
    transformer     6    main          1.19          1.20       1.16        1202.0
    transformer     6    branch        1.14          1.06       1.10        1142.2
    deep           15    main     1.34 / 1.38   1.32 / 1.34  1.54 / 1.59  71.0 / 73.7
    deep           15    branch   2.25 / 1.67   1.42 / 1.49  1.56 / 1.50  74.8 / 84.7

The deep model's wall ratios are noise at that load (its ZeRO-2 step took 105-312 ms
between runs); its CPU ratio did not move measurably: what is left there is structural (per
parameter shards: a copy-out per gather and one optimizer tensor per parameter).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import io
import os
import pstats
import resource
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
    "optimizer": ("_hand_over", "end_backward", "step"),
}  # fmt: skip


class Breakdown:
    """Inclusive wall-clock seconds and calls per wrapped function, and per gc generation; with
    ``timeline``, also each call's start and end (ms from the step's start) and, for a gather,
    its size, in the last measured step."""

    def __init__(self, timeline: bool = False):
        self.seconds: dict[str, list] = {}
        self.on = False
        self.timeline = timeline
        self.events: list[tuple] = []
        self.step_start = 0.0

    def add(self, label: str, seconds: float) -> None:
        entry = self.seconds.setdefault(label, [0.0, 0])
        entry[0] += seconds
        entry[1] += 1

    @staticmethod
    def install_all(breakdowns: dict[str, Breakdown]) -> None:
        """Wraps the timed functions once; each call counts in the breakdown that is on (the
        engine stepping now), if any."""
        from deepspeed_cpp.runtime.zero import coordinator, partitioned_optimizer, unit

        def active():
            return next((b for b in breakdowns.values() if b.on), None)

        def wrap(owner, name: str, label: str) -> None:
            original = getattr(owner, name)

            @functools.wraps(original)
            def timed(*args, **kwargs):
                breakdown = active()
                if breakdown is None:
                    return original(*args, **kwargs)
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    end = time.perf_counter()
                    breakdown.add(label, end - start)
                    if breakdown.timeline and label.startswith(("gather.", "coordinator.fetch")):
                        what = sum(args[0].sizes) if label.startswith("gather.") else args[1]
                        since = breakdown.step_start
                        breakdown.events.append(
                            (label, (start - since) * 1e3, (end - since) * 1e3, what)
                        )

            setattr(owner, name, timed)

        owners = {
            "coordinator": coordinator.ParameterCoordinator,
            "gather": unit._FlatGather,
            "optimizer": partitioned_optimizer.ZeroPartitionedOptimizer,
        }
        for kind, names in TIMED.items():
            for name in names:
                wrap(owners[kind], name, f"{kind}.{name}")
        started = {}

        def collections(phase, info):
            if phase == "start":
                started["at"] = time.perf_counter()
            elif (breakdown := active()) is not None:
                elapsed = time.perf_counter() - started["at"]
                breakdown.add(f"gc generation {info['generation']}", elapsed)

        gc.callbacks.append(collections)


def build(stage: int, model_name: str, whole_layers: bool, prefetch: float, persistence: int = 0):
    import deepspeed_cpp
    from deepspeed_cpp.runtime.zero import unit_tree

    if model_name == "deep":
        model = make_small_model("deep")
    else:
        model = make_transformer(8, 704, VOCAB, 0)
    zero = {"stage": stage, "reduce_bucket_size": 5_000_000}
    if stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": int(prefetch),
            "stage3_param_persistence_threshold": persistence if model_name == "deep" else 100_000,
            "stage3_max_live_parameters": 1_000_000_000,
            "stage3_max_reuse_distance": 1_000_000_000,
        })  # fmt: skip
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }
    capped = unit_tree.repeated_blocks
    if whole_layers:  # the block cap lifted for this engine only
        unit_tree.repeated_blocks = lambda c, m, cap: capped(c, m, 1 << 62)
    try:
        engine, *_ = deepspeed_cpp.initialize(model=model, config=config)
    finally:
        unit_tree.repeated_blocks = capped
    return engine


def engine_labels(args) -> list[str]:
    """ZeRO-2, ZeRO-3 as configured, and with ``--whole-layers`` ZeRO-3 with whole-layer units
    too, all in the same processes."""
    return [ZERO2, ZERO3] + ([WHOLE] if args.whole_layers else [])


ZERO2, ZERO3, WHOLE = "ZeRO-2", "ZeRO-3", "ZeRO-3 whole layers"
LANDED_SLEEP_S = 0.015  # ``--probe landed``: longer than the deep model's exchange takes
_PROBE_SLEPT = [0.0]  # seconds ``--probe landed`` slept in this process so far


def _clock() -> float:
    """Wall-clock seconds, less what ``--probe landed`` slept (no probe: ``perf_counter``)."""
    return time.perf_counter() - _PROBE_SLEPT[0]


def install_probe(probe: str) -> None:
    """``--probe`` (see the module docstring): patches these processes' ZeRO-3 gathers."""
    from deepspeed_cpp.runtime.zero import partition_parameters as pp
    from deepspeed_cpp.runtime.zero import partitioned_params, unit

    if probe == "landed":
        launch = unit._FlatGather.launch

        def launch_then_sleep(gather):
            launch(gather)  # a collective every rank reaches alike
            slept = time.perf_counter()
            time.sleep(LANDED_SLEEP_S)
            _PROBE_SLEPT[0] += time.perf_counter() - slept  # what was slept, oversleep included

        unit._FlatGather.launch = launch_then_sleep
        return
    release = pp.release

    def release_keeping_storage(param):
        whole = getattr(param, "ds_whole", None)
        if whole is None:
            return release(param)
        # release empties ds_whole's storage: hand it a stand-in, put the real one back.
        param.ds_whole = torch.empty(0, dtype=whole.dtype, device=whole.device)
        try:
            return release(param)
        finally:
            param.ds_whole = whole

    pp.release = release_keeping_storage
    whole_buffer = pp.whole_buffer

    def whole_buffer_kept(param, numel, dtype=None, device=None):
        # Resizing a storage to the size it has allocates a new one and copies (torch's CPU
        # resize): a kept storage is handed back as it is.
        whole = getattr(param, "ds_whole", None)
        if whole is not None and whole.untyped_storage().nbytes() == numel * whole.element_size():
            return whole
        return whole_buffer(param, numel, dtype, device)

    pp.whole_buffer = whole_buffer_kept
    partitioned_params.whole_buffer = whole_buffer_kept  # start_gather's (one parameter alone)
    if probe == "no-copy-out":
        copy_out, copied = unit._FlatGather._copy_out, set()

        def first_copy_out_only(gather, data, wholes):
            key = tuple(id(p) for p in gather.params)
            if key not in copied:
                copied.add(key)
                copy_out(gather, data, wholes)

        unit._FlatGather._copy_out = first_copy_out_only


def _minor_faults() -> int:
    """This process's minor page faults so far: fresh pages written (a buffer allocated anew)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _top_functions(profile: cProfile.Profile, count: int = 40) -> str:
    """The functions with the most own time, then the most time inclusive, as pstats prints
    them (over all measured steps)."""
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(count)
    stats.sort_stats("cumulative").print_stats(count)
    return text.getvalue()


def worker(rank: int, args) -> dict:
    torch.set_num_threads(1)
    if args.probe:
        install_probe(args.probe)
    breakdowns = {label: Breakdown(args.timeline) for label in engine_labels(args)}
    if args.breakdown or args.timeline:
        Breakdown.install_all(breakdowns)
    engines = {
        label: build(
            2 if label == ZERO2 else 3, args.model, label == WHOLE, args.prefetch, args.persistence
        )
        for label in engine_labels(args)
    }
    generator = torch.Generator().manual_seed(100 + rank)
    times: dict[str, list[float]] = {label: [] for label in engines}
    cpu: dict[str, list[float]] = {label: [] for label in engines}
    thread: dict[str, list[float]] = {label: [] for label in engines}
    # Wall time of each phase of a step, per engine: forward, backward, step.
    phases: dict[str, list[list[float]]] = {label: [] for label in engines}
    # --cprofile: one profiler per engine, on for its measured steps (rank 0's main thread).
    profiling = args.cprofile and rank == 0
    profiles = {label: cProfile.Profile() for label in engines} if profiling else {}
    for round_index in range(args.warmup + args.rounds):
        if args.model == "deep":
            batch = torch.randn(32, 256, generator=generator)
        else:
            batch = torch.randint(0, VOCAB, (4, SEQ), generator=generator)
        for label, engine in engines.items():
            dist.barrier()
            measured = round_index >= args.warmup
            breakdown = breakdowns.get(label)
            if breakdown is not None and measured:
                breakdown.on = True
                breakdown.events.clear()  # the timeline keeps the last measured step's
                breakdown.step_start = time.perf_counter()
            profile = profiles.get(label) if measured else None
            if profile is not None:
                profile.enable()
            start, cpu_start = _clock(), time.process_time()
            thread_start, faults_start = time.thread_time(), _minor_faults()
            output = engine(batch)
            loss = output.square().mean() if args.model == "deep" else lm_loss(output, batch)
            forward_end, forward_cpu = _clock(), time.process_time()
            forward_faults = _minor_faults()
            engine.backward(loss)
            backward_end, backward_cpu = _clock(), time.process_time()
            backward_faults = _minor_faults()
            engine.step()
            if profile is not None:
                profile.disable()
            if measured:
                phases[label].append(
                    [
                        forward_end - start,
                        backward_end - forward_end,
                        _clock() - backward_end,
                        forward_cpu - cpu_start,
                        backward_cpu - forward_cpu,
                        time.process_time() - backward_cpu,
                        forward_faults - faults_start,
                        backward_faults - forward_faults,
                        _minor_faults() - backward_faults,
                    ]
                )
                times[label].append(_clock() - start)
                cpu[label].append(time.process_time() - cpu_start)
                thread[label].append(time.thread_time() - thread_start)
            if breakdown is not None:
                breakdown.on = False
    return {
        "step": {label: statistics.median(values) for label, values in times.items()},
        "mean": {label: statistics.fmean(values) for label, values in times.items()},
        "cpu": {label: statistics.median(values) for label, values in cpu.items()},
        "thread": {label: statistics.median(values) for label, values in thread.items()},
        "phases": {label: [statistics.median(column) for column in zip(*rows)]
                   for label, rows in phases.items()},
        "breakdown": {label: {k: (v[0] / args.rounds, v[1] / args.rounds)
                              for k, v in b.seconds.items()}
                      for label, b in breakdowns.items()},
        "timeline": {label: b.events for label, b in breakdowns.items()},
        "profile": {label: _top_functions(p) for label, p in profiles.items()},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("deep", "transformer"), default="deep")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--whole-layers", action="store_true")
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print rank 0's fetches and gathers in the last measured step",
    )
    parser.add_argument("--prefetch", type=float, default=5e6, help="stage3_prefetch_bucket_size")
    parser.add_argument(
        "--probe",
        choices=("keep-storage", "no-copy-out", "landed"),
        help="timing probe of ZeRO-3's gathers (see the module docstring)",
    )
    parser.add_argument(
        "--persistence",
        type=int,
        default=0,
        help="the deep model's stage3_param_persistence_threshold (see the module docstring)",
    )
    parser.add_argument(
        "--cprofile",
        action="store_true",
        help="cProfile rank 0's measured steps per engine and print the top functions",
    )
    args = parser.parse_args()
    ranks = run_on_ranks(2, worker, args)
    labels = engine_labels(args)

    def slowest(key, label):  # a step is as slow as its slowest rank
        return max(r[key][label] for r in ranks)

    persistence = args.persistence if args.model == "deep" else 100_000
    print(f"{args.model} model, 2 gloo ranks x 1 thread, median of {args.rounds} interleaved "
          f"rounds after {args.warmup}, prefetch {args.prefetch:g}, persistence "
          f"{persistence}, probe {args.probe or 'none'}")  # fmt: skip
    # CPU: the process's CPU time per step, all its threads (the work, whatever the load).
    print(f"{'':33} {'median ms':>10} {'mean ms':>8} {'CPU ms':>7} {'main thread':>11}")
    for label in labels:
        print(f"deepspeed_cpp {label:19} {slowest('step', label) * 1e3:10.1f} "
              f"{slowest('mean', label) * 1e3:8.1f} {slowest('cpu', label) * 1e3:7.1f} "
              f"{slowest('thread', label) * 1e3:11.1f}")  # fmt: skip
    for label in labels[1:]:
        print(f"{label + ' / ZeRO-2':33} {slowest('step', label) / slowest('step', ZERO2):10.2f} "
              f"{slowest('mean', label) / slowest('mean', ZERO2):8.2f} "
              f"{slowest('cpu', label) / slowest('cpu', ZERO2):7.2f}")  # fmt: skip
    # Wall time, then the process's CPU time (all threads: the work, whatever the load).
    print(f"{'phases (median ms, slowest rank)':33} {'forward':>10} {'backward':>8} {'step':>7}"
          f" {'CPU fwd':>8} {'CPU bwd':>8} {'CPU step':>8}")  # fmt: skip
    for label in labels:
        cells = [max(r["phases"][label][i] for r in ranks) * 1e3 for i in range(6)]
        print(f"deepspeed_cpp {label:19} {cells[0]:10.1f} {cells[1]:8.1f} {cells[2]:7.1f} "
              f"{cells[3]:8.1f} {cells[4]:8.1f} {cells[5]:8.1f}")  # fmt: skip
    print(f"{'minor page faults (median)':33} {'forward':>10} {'backward':>8} {'step':>7}")
    for label in labels:
        cells = [max(r["phases"][label][i] for r in ranks) for i in range(6, 9)]
        print(f"deepspeed_cpp {label:19} {cells[0]:10.0f} {cells[1]:8.0f} {cells[2]:7.0f}")
    if args.breakdown:
        for label in labels:
            print(f"  {label} per step (rank 0 / rank 1, inclusive ms; calls):")
            for name in sorted(ranks[0]["breakdown"][label]):
                cells = [r["breakdown"][label].get(name, (0.0, 0)) for r in ranks]
                print(f"    {name:34} {cells[0][0] * 1e3:8.2f} / {cells[1][0] * 1e3:8.2f}"
                      f"   {cells[0][1]:6.1f}")  # fmt: skip
    if args.timeline:
        for label in labels[1:]:
            print(f"  {label}, rank 0, last measured step (ms from its start; fetch: unit, "
                  "gather: shard elements):")  # fmt: skip
            for name, start, end, what in ranks[0]["timeline"][label]:
                print(f"    {name:20} {start:9.1f} {end:9.1f} {end - start:8.1f}  {what}")

    for label, text in ranks[0]["profile"].items():
        print(f"  cProfile of rank 0's {args.rounds} measured {label} steps (own time first):")
        print(text)


if __name__ == "__main__":
    main()
