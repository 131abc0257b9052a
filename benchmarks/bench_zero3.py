"""ZeRO-3: deepspeed_cpp's stage 3 against its stage 2, DDP, FSDP2 and DeepSpeed's stage 3.

Two parts (``--parts``). ``table`` (zero3_table.py): each implementation in processes of its
own (DeepSpeed 0.19.8 from ``--deepspeed-path`` with ``DS_ACCELERATOR=cpu``, never imported beside
our package) on the ~50M-parameter transformer and on the latency-bound 48 x (Linear 256 +
LayerNorm) model: collectives per step (process groups' sequence numbers), bytes sent per step
(``/proc/self/io`` wchar: gloo's TCP sends), step time and peak RSS per rank, with the issue-27
ratios. ``detail``: the same ~50M-parameter transformer as ``bench_zero.py``, N processes on gloo
(CPU), DeepSpeed in the memory rounds only (its own processes), in three parts:

1. Step time: every implementation in the same processes, one step of each per round (median
   after a warm-up), split into forward, backward and update (this rank's own clock), and the
   fraction of our stage 3's all-gather time hidden behind compute.
2. Peak RSS per rank: one implementation per launch (its own processes), ``--rss-rounds`` rounds
   with the order rotated; the peak over the measured steps (the high-water mark is reset after
   the warm-up, so building the model whole before partitioning it does not count), beside the
   RSS at their start (torch alone holds hundreds of MiB).
3. Peak tensor memory per rank, the same tracker for all: the c10 CPU allocator's live bytes as
   torch.profiler (profile_memory) reports them, on from before the model is built, its peak
   over the measured steps (parameters, gradients, optimizer state, gathered and communication
   buffers, activations). deepspeed_cpp's own accounting (shards, gradients, moments, the
   coordinator's peak of gathered parameters, the reducer's peak) is printed beside it.

    python benchmarks/bench_zero3.py [--deepspeed-path /work/ds_target] [--parts table detail]
        [--models transformer deep] [--steps 3] [--rounds 6] [--rss-rounds 3] [--prefetch 5e6]

DeepSpeed runs when it can be imported (with ``--deepspeed-path`` prepended to ``sys.path`` in
its rank processes only) with ``DS_ACCELERATOR=cpu``; otherwise the tables say why and go on.
Both ZeRO-3s get the same ``zero_optimization`` keys (reduce bucket ``--bucket``, prefetch bucket
``--prefetch``, reuse distance ``--max-reuse-distance`` elements, persistence threshold
``--persistence`` (DeepSpeed's default 1e5) on the transformer and ``--deep-persistence`` (0: every
parameter partitioned; at 1e5 the deep model's would all stay whole) on the deep model, live limit
at DeepSpeed's default).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from bench_zero import (
    DDP,
    FSDP2,
    SEQ,
    VOCAB,
    adam_moment_bytes,
    add_model_args,
    build_ddp,
    build_fsdp2,
    build_zero,
    engine_phases,
    interleaved_medians,
    make_model,
    not_run_note,
    run_step,
    zero_config,
)
from gloo_ranks import run_on_ranks
from zero3_table import MODELS, print_table, table_rows

OURS2 = "deepspeed_cpp ZeRO-2"
OURS3 = "deepspeed_cpp ZeRO-3"
DS3 = "DeepSpeed ZeRO-3"
NAMES = (DDP, OURS2, OURS3, FSDP2, DS3)
TARGETS = {OURS2: "<= 1.15", FSDP2: "<= 0.80", DS3: ""}


def stage3_keys(args) -> dict:
    return {
        "stage3_prefetch_bucket_size": int(args.prefetch),
        "stage3_param_persistence_threshold": int(args.persistence),
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": int(args.max_reuse_distance),
    }


def build_deepspeed(args):
    """(phases, engine) of DeepSpeed's ZeRO-3, imported from ``--deepspeed-path`` (this rank
    process only) on its CPU accelerator; it reuses the gloo group already initialised."""
    if args.deepspeed_path:
        sys.path.insert(0, args.deepspeed_path)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = make_model(args.layers, args.width, VOCAB, 0)
    engine, _, _, _ = deepspeed.initialize(
        model=model, config=zero_config(args, 3, **stage3_keys(args))
    )
    torch.set_num_threads(args.threads)  # whatever DeepSpeed's CPU accelerator chose
    return engine_phases(engine), engine


def build(name: str, args):
    if name == DDP:
        return build_ddp(args)
    if name == OURS2:
        return build_zero(args, 2)
    if name == OURS3:
        return build_zero(args, 3, **stage3_keys(args))
    if name == FSDP2:
        return build_fsdp2(args)
    return build_deepspeed(args)


class GatherTimer:
    """Benchmark-only wrappers of ``launch_gather``/``wait_gather``, replaced both where they
    live (``partitioned_params``: ``release`` and ``gather_all`` look them up there) and under
    ``partition_parameters`` (where the coordinator's units look them up), so that every call
    is seen: counts the gathers actually launched and the seconds spent blocked on ones in
    flight, which is the part of the all-gather time that compute did not hide."""

    def __init__(self):
        from deepspeed_cpp.runtime.zero import partition_parameters, partitioned_params

        pp = partitioned_params
        self.pp, self.launch, self.wait = pp, pp.launch_gather, pp.wait_gather
        self.waited, self.launched = 0.0, []
        for module in (partitioned_params, partition_parameters):
            module.launch_gather, module.wait_gather = self._launch, self._wait

    def _launch(self, param, group=None) -> None:
        starts = not param.ds_persist and param.ds_status == self.pp.ZeroParamStatus.NOT_AVAILABLE
        self.launch(param, group)
        if starts:
            self.launched.append(param)

    def _wait(self, param) -> None:
        if param.ds_status != self.pp.ZeroParamStatus.INFLIGHT:
            return self.wait(param)
        start = time.perf_counter()
        self.wait(param)
        self.waited += time.perf_counter() - start

    def take(self) -> tuple[float, list]:
        taken = self.waited, self.launched
        self.waited, self.launched = 0.0, []
        return taken

    def serial_seconds(self, params: list, repeats: int = 3) -> float:
        """Seconds to gather ``params`` one after the other with nothing to overlap (the same
        sequence on every rank), median of ``repeats``."""
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for param in params:
                self.launch(param)
                self.wait(param)
                self.pp.release(param)
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def with_gather_timing(phases, timer: GatherTimer, record: list):
    """``phases`` recording, per step, the seconds blocked on gathers in each phase and the
    gathers launched."""

    def timed(phase):
        def run(*args):
            result = phase(*args)
            waited, launched = timer.take()
            record.append((phase_name[phase], waited, launched))
            return result

        return run

    phase_name = {phases.forward: "forward", phases.backward: "backward", phases.update: "update"}
    return type(phases)(*(timed(p) for p in phases))


def timing_worker(rank: int, args):
    torch.set_num_threads(args.threads)
    steppers, notes, handles = {}, [], {}
    # DeepSpeed only ever runs in processes of its own (the table, the memory rounds): never
    # beside our package in one interpreter.
    for name in (n for n in NAMES if n != DS3):
        try:
            steppers[name], handles[name] = build(name, args)
            run_step(steppers[name], torch.randint(0, VOCAB, (args.micro_batch, SEQ)))
        except Exception as error:  # noqa: BLE001 - a reference that cannot run here is reported
            steppers.pop(name, None)
            notes.append(not_run_note(name, error))
    if OURS3 not in steppers:
        raise RuntimeError("; ".join(notes))
    timer, record = GatherTimer(), []
    steppers[OURS3] = with_gather_timing(steppers[OURS3], timer, record)
    medians = interleaved_medians(steppers, args, rank)
    measured = record[3 * args.warmup :]  # three phases per step
    waits = {phase: sum(w for p, w, _ in measured if p == phase) / args.rounds
             for phase in ("forward", "backward", "update")}  # fmt: skip
    one_step = [param for _, _, launched in measured[-3:] for param in launched]
    serial = timer.serial_seconds(one_step)
    numel = sum(p.ds_numel for p in one_step)
    return medians, notes, waits, serial, len(one_step), numel


def current_rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def isolated_worker(rank: int, args, name: str, tracked: bool):
    """Peak RSS (``tracked`` False) or peak tensor bytes (True) of one implementation over
    ``args.memory_steps`` steps after ``args.warmup``, in processes of its own."""
    torch.set_num_threads(args.threads)
    profiler = None
    if tracked:
        profiler = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True
        )
        profiler.start()
    phases, handle = build(name, args)
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randint(0, VOCAB, (args.micro_batch, SEQ), generator=generator)
               for _ in range(args.warmup + args.memory_steps)]  # fmt: skip
    for tokens in batches[: args.warmup]:
        run_step(phases, tokens)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    start_rss = current_rss()
    with torch.profiler.record_function("measured steps"):
        for tokens in batches[args.warmup :]:
            run_step(phases, tokens)
    peak_rss = current_rss("VmHWM")
    result = {"start_rss": start_rss, "peak_rss": peak_rss}
    if tracked:
        profiler.stop()
        result["peak_tensors"] = peak_tensor_bytes(profiler, "measured steps")
        if name in (OURS2, OURS3):
            result["own"] = own_accounting(handle)
    return result


def peak_tensor_bytes(profiler, marker: str) -> int:
    """The peak of live CPU-allocator bytes after ``marker`` began (every allocation since the
    profiler started is in the running sum, so it starts from the true live bytes)."""
    events = profiler.profiler.kineto_results.events()
    begin = min(e.start_ns() for e in events if e.name() == marker)
    live, peak = 0, 0
    for when, nbytes in sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"
    ):
        live += nbytes
        if when >= begin:
            peak = max(peak, live)
    return peak


def own_accounting(engine) -> dict:
    """deepspeed_cpp's view of its per-rank memory: parameter storage (shards and persistent
    parameters at stage 3), shard gradients, optimizer state, fp32 masters that are not the
    parameters, and the peaks of gathered parameters (stage 3) and of reduction buffers."""
    zero = engine.optimizer
    storages = {}
    for param in engine.module.parameters():
        tensor = param.ds_tensor if hasattr(param, "ds_id") else param
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    params = sum(storages.values())
    masters = sum(m.untyped_storage().nbytes() for m in zero.masters
                  if m.untyped_storage().data_ptr() not in storages)  # fmt: skip
    gathered = 0
    if hasattr(zero, "coordinator"):
        gathered = zero.coordinator.peak_live_numel() * 4  # fp32 model
    own = {
        "parameters": params,
        "gradients": sum(g.numel() * g.element_size() for g in zero.shard_grads),
        "Adam moments": adam_moment_bytes(zero.optimizer),
        "masters": masters,
        "gathered peak": gathered,
        "reducer peak": zero.reducer.peak_held_bytes(),
    }
    own["total"] = sum(own.values())
    return own


def memory_runs(args) -> tuple[dict, dict, list]:
    """Per implementation: the RSS results of every round and the tracked one (each a list of
    per-rank dicts), and notes on implementations that failed."""
    rss, tracked, notes = {n: [] for n in NAMES}, {}, []
    failed = set()
    for round_index in range(args.rss_rounds + 1):
        order = NAMES[round_index % len(NAMES) :] + NAMES[: round_index % len(NAMES)]
        for name in order:
            if name in failed:
                continue
            is_tracked = round_index == args.rss_rounds  # the profiler's own memory last
            try:
                reports = run_on_ranks(args.procs, isolated_worker, args, name, is_tracked)
            except RuntimeError as error:
                failed.add(name)
                notes.append(f"{name} memory not measured: {str(error).splitlines()[-1][:120]}")
                continue
            if is_tracked:
                tracked[name] = reports
            else:
                rss[name].append(reports)
    return rss, tracked, notes


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:8.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(parser)
    parser.add_argument("--prefetch", type=float, default=5e6,
                        help="stage3_prefetch_bucket_size (elements), both ZeRO-3s")  # fmt: skip
    parser.add_argument("--max-reuse-distance", type=float, default=1e9,
                        help="stage3_max_reuse_distance (elements), both ZeRO-3s; DeepSpeed's "
                        "default keeps every parameter gathered from its forward to its backward; "
                        "0 gathers it again for the backward (less memory)")  # fmt: skip
    parser.add_argument("--deepspeed-path", default="", help="prepended to sys.path for DeepSpeed")
    parser.add_argument("--rss-rounds", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=("table", "detail"),
                        default=["table", "detail"],
                        help="table: each implementation in its own processes on both models "
                        "(collectives, bytes, step, peak RSS); detail: the interleaved step "
                        "times, memory rounds and gather overlap of the transformer")  # fmt: skip
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=3, help="measured steps per launch (table)")
    parser.add_argument("--persistence", type=float, default=100_000,
                        help="stage3_param_persistence_threshold, transformer")  # fmt: skip
    parser.add_argument("--deep-persistence", type=float, default=0,
                        help="stage3_param_persistence_threshold, deep model")  # fmt: skip
    parser.add_argument("--impls", nargs="+", choices=(OURS2, OURS3, FSDP2, DS3),
                        help="the table's implementations (default: all that can run)")  # fmt: skip
    args = parser.parse_args()
    started = time.perf_counter()
    if "table" in args.parts:
        impls = [OURS2, OURS3, FSDP2, DS3] if args.deepspeed_path else [OURS2, OURS3, FSDP2]
        impls = [impl for impl in impls if impl in (args.impls or impls)]
        rows, notes = table_rows(args, impls)
        if not args.deepspeed_path:
            notes.append(f"{DS3} not run: no --deepspeed-path given")
        print_table(rows, notes, args)
        if "detail" not in args.parts:
            print(f"(run took {time.perf_counter() - started:.0f} s)")
            return
    reports = run_on_ranks(args.procs, timing_worker, args)
    rss, tracked, memory_notes = memory_runs(args)
    medians, notes, _, _, _, _ = reports[0]
    n_params = sum(p.numel() for p in make_model(args.layers, args.width, VOCAB, 0).parameters())
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU")  # fmt: skip
    print(f"{n_params / 1e6:.1f}M-parameter transformer, {args.procs} processes x {args.threads} "
          f"thread(s) (gloo, CPU: {cpu}), micro-batch {args.micro_batch} x {SEQ} tokens; step: "
          f"median of {args.rounds} interleaved rounds after {args.warmup}, slowest rank; "
          f"memory: max over ranks, {args.memory_steps} steps after {args.warmup}")  # fmt: skip
    for note in notes + memory_notes:
        print(note)

    def step(name, part=0):  # a step is as slow as its slowest rank
        return max(r[0][name][part] for r in reports)

    def peak_rss(name):  # median over rounds of the max over ranks
        return statistics.median(max(r["peak_rss"] for r in rnd) for rnd in rss[name])

    def start_rss(name):
        return statistics.median(max(r["start_rss"] for r in rnd) for rnd in rss[name])

    def tensors(name):
        return max(r["peak_tensors"] for r in tracked[name])

    print(f"{'implementation':<26} {'step s':>7} {'fwd s':>6} {'bwd s':>6} {'upd s':>6} "
          f"{'/ DDP':>6} {'tensors MiB':>11} {'RSS peak MiB':>12} {'RSS start':>9}")  # fmt: skip
    for name in medians:
        print(f"{name:<26} {step(name):7.3f} {step(name, 1):6.3f} {step(name, 2):6.3f} "
              f"{step(name, 3):6.3f} {step(name) / step(DDP):6.2f} "
              f"{mib(tensors(name)) if name in tracked else '       -':>11} "
              f"{mib(peak_rss(name)) if rss[name] else '       -':>12} "
              f"{mib(start_rss(name)) if rss[name] else '       -':>9}")  # fmt: skip
    print(f"\n{'ratio':<52} {'step':>6} {'tensors':>8} {'RSS peak':>9} {'step target':>12}")
    for reference, target in TARGETS.items():
        if reference not in medians:
            continue
        ratio_t = tensors(OURS3) / tensors(reference) if reference in tracked else float("nan")
        ratio_r = peak_rss(OURS3) / peak_rss(reference) if rss[reference] else float("nan")
        print(f"{OURS3 + ' / ' + reference:<52} {step(OURS3) / step(reference):6.2f} "
              f"{ratio_t:8.2f} {ratio_r:9.2f} {target:>12}")  # fmt: skip
    waits = {phase: max(r[2][phase] for r in reports) for phase in reports[0][2]}
    serial, gathers, numel = max(r[3] for r in reports), reports[0][4], reports[0][5]
    exposed = sum(waits.values())
    print(f"\n{OURS3} all-gathers per step: {gathers} ({numel / 1e6:.1f}M elements), "
          f"{serial:.3f} s one after another with nothing to overlap; blocked on them "
          f"{exposed:.3f} s per step (forward {waits['forward']:.3f}, backward "
          f"{waits['backward']:.3f}, update {waits['update']:.3f}): "
          f"{max(0.0, 1 - exposed / serial):.0%} hidden behind compute")  # fmt: skip
    for name in (OURS2, OURS3):
        if name in tracked:
            own = {k: max(r["own"][k] for r in tracked[name]) for k in tracked[name][0]["own"]}
            print(
                f"{name} own accounting per rank (MiB): "
                + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in own.items())
            )
    print(f"(a full fp32 copy of the parameters: {4 * n_params / 2**20:.1f} MiB; "
          f"run took {time.perf_counter() - started:.0f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
