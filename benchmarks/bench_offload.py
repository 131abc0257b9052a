"""ZeRO-Offload: deepspeed_cpp's optimizer offload (cpu, nvme, cpu + delayed update) against
in-memory ZeRO and against real DeepSpeed's same configs, with the disk's own speed beside it.

The model is a stack of ``Linear(width, width) + ReLU`` blocks with ``--params`` parameters
(~200M by default), trained in ``--dtype`` (bf16 by default, fp32 masters) with the config
optimizer AdamW, one micro-batch of ``--micro-batch`` random rows per step, loss = mean(out^2).
Every row is one launch of its own ``--procs`` processes (torch.distributed gloo, CPU), so peak
RSS belongs to that config alone; DeepSpeed runs in its own venv (``--ds-python``, with
``DS_ACCELERATOR=cpu``) from this same file, and with offload it steps with its
DeepSpeedCPUAdam (what it picks for the config's AdamW). Both get the same ds_config:
``reduce_bucket_size`` ``--bucket``, ``sub_group_size`` ``--sub-group-size``, for NVMe
``pipeline_read``/``pipeline_write`` on and ``buffer_count`` ``--buffer-count``, and the same
``aio`` section (1 MiB blocks, queue depth 8).

Rows (``z<stage> <where>``):
  mem        in-memory ZeRO: fp32 masters and Adam moments in this process's memory (reference)
  cpu        offload_optimizer device cpu: masters, moments, gradient copies in host memory
  nvme       offload_optimizer device nvme: masters and moments in swap files under the NVMe
             folder, brought in a sub-group at a time through buffer_count buffers (DeepSpeed
             allows NVMe optimizer offload at stage 3 only: its stage-2 nvme row is "n/a");
             deepspeed_cpp steps each sub-group (and swaps it) inside backward once its buckets
             are reduced (``step_during_backward``, on by default for NVMe where nothing
             excludes it)
  cpu+dpu    cpu offload with deepspeed_cpp's delayed parameter update (warm-up 1 step): the
             Adam step runs in a background thread during the next forward/backward (DeepSpeed
             has no such option: "n/a")
  nvme-sdb   nvme with ``step_during_backward: false``: every sub-group swapped and stepped in
             engine.step(), DeepSpeed's schedule (DeepSpeed has no such key: "n/a")
  param      offload_param cpu + offload_optimizer cpu at stage 3 (``--param-row``): parameter
             shards in host memory between uses, fetched ahead of use by the stage-3 prefetcher
  nvme+pnvme offload_param nvme + offload_optimizer nvme at stage 3 (``--param-row``):
             ZeRO-Infinity, parameter shards in swap files too

Columns (per config; times are the median over ``--steps`` timed steps after ``--warmup``, each
step from barrier to barrier and as slow as its slowest rank):
  step s       one training step (forward, backward, engine.step)
  f+b s        forward + backward; upd s: engine.step (the optimizer step, swaps included)
  RSS MiB      peak resident set per process (max over ranks) over the timed steps, the
               high-water mark reset after the warm-up (``/proc/self/clear_refs``); start:
               the RSS of the process with torch imported, before the engine's library (the two
               venvs' torch builds differ: ours is a CUDA build, whose libraries take more);
               trim: the RSS after the timed steps once ``malloc_trim(0)`` has handed glibc's
               free heap memory back (RSS - trim = freed memory the allocator still held)
  state MiB    deepspeed_cpp's optimizer bytes in host memory per rank
               (``optimizer.state_bytes()``: fp32 masters + moments (+ host gradient buffers for
               offload); for nvme the swap buffers only); disk MiB: its swap files' bytes
  wr/rd MiB    bytes written to / read from storage per step and process (``/proc/self/io``
               write_bytes/read_bytes, the same counter for both implementations)
  I/O GB/s     (written + read) / step time, all ranks together: the swap rate the step sustains
  hidden       the fraction of swap I/O hidden behind compute, (io + compute - step) / io, where
               io = the pure swap time (below) and compute = the cpu row's step time (the same
               work without the disk); clamped to [0, 1]
  /DS          ours / DeepSpeed's step time and peak RSS for the same config

Pure swap I/O (deepspeed_cpp nvme rows): after the timed steps, in the same processes, every
sub-group is read from its swap file into the same buffers and written back through the same
``SwapFolder`` (up to buffer_count in flight, all ranks at once): the time the disk needs for one
step's swap bytes with nothing else to do. ``fio`` (when installed) measures the same folder:
sequential 1 MiB blocks, direct=1, libaio at queue depth 8, one job per process, each a file the
size of a rank's optimizer state.

Targets (printed with PASS/FAIL):
  (1) NVMe optimizer offload step <= 1.2 x max(in-memory step, pure swap I/O time)
  (2) NVMe peak RSS <= in-memory peak RSS - 0.8 x optimizer state per rank
      (state = fp32 masters + exp_avg + exp_avg_sq = 12 bytes x parameters / processes)
  (3) ours faster than DeepSpeed on every config both run

Run (the default takes ~12 minutes on 2 cores):

    PYTHONPATH=. python benchmarks/bench_offload.py [--params 200e6] [--dtype bf16|fp32]
        [--procs 1 2] [--stages 2 3] [--steps 4] [--warmup 2] [--nvme-path DIR]
        [--ds-python /work/ds_venv/bin/python] [--param-row]

``--stages 2`` (default) runs the stage-2 rows and stage-3 mem, cpu and nvme (stage 3 is the only
one where DeepSpeed offloads to NVMe); ``--stages 2 3`` adds stage-3 cpu+dpu. NVMe buffers: our
``buffer_count`` counts sub-group buffers (16 bytes per element), DeepSpeed's counts per-tensor
buffers (4 bytes per element): DeepSpeed gets ``--ds-buffer-count`` 16, the same bytes as our 4
(with pipelining its AdamW runs out of buffers at 4 and 8: "try increasing 'buffer_count'").
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from gloo_ranks import run_on_ranks

OURS, DS = "deepspeed_cpp", "DeepSpeed"
LR = 1e-4


# --- the model and the config -----------------------------------------------------------------


def layer_count(params: float, width: int) -> int:
    return max(1, round(params / (width * width + width)))


def make_model(params: float, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layer_count(params, width)):
        blocks += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


def ds_config(spec: dict) -> dict:
    """The ds_config both implementations get for ``spec`` (stage, where, NVMe folder, sizes)."""
    zero = {"stage": spec["stage"], "reduce_bucket_size": int(spec["bucket"]),
            "sub_group_size": int(spec["sub_group_size"])}  # fmt: skip
    where = spec["where"]
    if where in ("cpu", "param"):
        zero["offload_optimizer"] = {"device": "cpu"}
    elif where == "cpu+dpu":
        zero["offload_optimizer"] = {"device": "cpu", "delayed_param_update": True,
                                     "delayed_param_update_warmup_steps": 1}  # fmt: skip
    elif where.startswith("nvme"):
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": spec["folder"],
                                     "pipeline_read": True, "pipeline_write": True,
                                     "buffer_count": spec["buffer_count"]}  # fmt: skip
        if spec["impl"] == DS:  # DeepSpeed counts one buffer per state tensor (see --help)
            zero["offload_optimizer"]["buffer_count"] = spec["ds_buffer_count"]
    if where == "param":
        zero["offload_param"] = {"device": "cpu"}
    elif where == "nvme+pnvme":
        zero["offload_param"] = {"device": "nvme", "nvme_path": spec["folder"]}
    elif where == "nvme-sdb":
        zero["offload_optimizer"]["step_during_backward"] = False
    config = {
        "train_micro_batch_size_per_gpu": spec["micro_batch"],
        # Off for both libraries (their default is 1.0): clipping would keep ours from stepping
        # during backward, the overlap these rows measure.
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 8,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },  # fmt: skip
    }
    if spec["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    return config


# --- one config in its own processes ----------------------------------------------------------


def proc_io() -> tuple[int, int]:
    """(write_bytes, read_bytes) this process caused to reach storage."""
    values = {}
    with open("/proc/self/io") as io:
        for line in io:
            key, value = line.split(":")
            values[key] = int(value)
    return values["write_bytes"], values["read_bytes"]


def status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def pure_swap_seconds(home, repeats: int = 2) -> float:
    """Seconds to read every sub-group of ``home`` (an NvmeHome) from its swap file into the
    swap buffers and write it back, up to one transfer per buffer in flight, all ranks at once
    (median of ``repeats``). The bytes, files, buffers and aio handles are the step's own."""
    home._finish_writes()
    slots, times = len(home._slots), []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for kind in ("read", "write"):
            tickets = {}
            for group in range(len(home.sub_groups)):
                slot = group % slots
                if slot in tickets:
                    tickets.pop(slot).wait()
                region = home._persisted(group, slot)
                if kind == "read":
                    tickets[slot] = home._files.read(home.committed_key(group), region)
                else:
                    tickets[slot] = home._files.write(home.committed_key(group), region)
            for ticket in tickets.values():
                ticket.wait()
        times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(times)


def rank_worker(rank: int, spec: dict) -> dict:
    threads = spec["threads"]
    torch.set_num_threads(threads)
    start_rss = status_bytes("VmRSS")
    if spec["impl"] == DS:
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        initialize = deepspeed.initialize
    else:
        import deepspeed_cpp

        initialize = deepspeed_cpp.initialize
    model = make_model(spec["params"], spec["width"])
    engine, _, _, _ = initialize(model=model, config=ds_config(spec))
    del model
    torch.set_num_threads(threads)  # whatever DeepSpeed's CPU accelerator chose
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(100 + rank)
    batches = [torch.randn(spec["micro_batch"], spec["width"], generator=generator).to(dtype)
               for _ in range(spec["warmup"] + spec["steps"])]  # fmt: skip

    def step(batch) -> tuple[float, float]:
        start = time.perf_counter()
        loss = engine(batch).float().pow(2).mean()
        engine.backward(loss)
        middle = time.perf_counter()
        engine.step()
        return middle - start, time.perf_counter() - middle

    for batch in batches[: spec["warmup"]]:
        step(batch)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak RSS (VmHWM) to the current RSS
    measured_start_rss = status_bytes("VmRSS")
    io_before = proc_io()
    steps = []
    for batch in batches[spec["warmup"] :]:
        dist.barrier()
        start = time.perf_counter()
        compute, update = step(batch)
        dist.barrier()
        steps.append((time.perf_counter() - start, compute, update))
    io_after = proc_io()
    peak_rss = status_bytes("VmHWM")
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hands glibc's free heap memory back to the kernel
    result = {
        "steps": steps,
        "start_rss": start_rss,
        "measured_start_rss": measured_start_rss,
        "peak_rss": peak_rss,
        "trimmed_rss": status_bytes("VmRSS"),
        "written": (io_after[0] - io_before[0]) / spec["steps"],
        "read": (io_after[1] - io_before[1]) / spec["steps"],
    }
    if spec["impl"] == OURS:
        zero = engine.optimizer
        result["state_bytes"] = zero.state_bytes()
        home = zero.home
        if home.kind == "nvme":
            result["disk_bytes"] = home.disk_bytes()
            result["sub_groups"] = len(home.sub_groups)
            result["swap_bytes"] = (
                2 * sum(home._layout[g][2] for g in range(len(home.sub_groups))) * 4
            )
            io_before = proc_io()
            result["pure_swap_s"] = pure_swap_seconds(home)
            io_after = proc_io()
            result["pure_swap_io"] = (io_after[0] - io_before[0] + io_after[1] - io_before[1]) / 2
    else:
        import deepspeed

        result["version"] = deepspeed.__version__
        result["optimizer"] = type(engine.optimizer.optimizer).__name__
    if hasattr(engine, "destroy"):
        engine.destroy()
    return result


def worker_main(spec_path: str, out_path: str) -> None:
    """The ``--worker`` entry: one config on ``spec['procs']`` gloo ranks, results to JSON."""
    with open(spec_path) as spec_file:
        spec = json.load(spec_file)
    reports = run_on_ranks(spec["procs"], rank_worker, spec)
    with open(out_path, "w") as out:
        json.dump(reports, out)


# --- the parent: launches, fio, tables --------------------------------------------------------


def run_config(spec: dict, python: str, env: dict, timeout: float) -> tuple[list | None, str]:
    """(per-rank reports, "") or (None, why it did not run)."""
    with tempfile.TemporaryDirectory(prefix="bench_offload_") as scratch:
        spec_path, out_path = os.path.join(scratch, "spec.json"), os.path.join(scratch, "out")
        with open(spec_path, "w") as spec_file:
            json.dump(spec, spec_file)
        command = [python, os.path.abspath(__file__), "--worker", spec_path, out_path]
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True,
                                  timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return None, f"timed out after {timeout:.0f} s"
        if done.returncode != 0 or not os.path.exists(out_path):
            lines = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            errors = [line for line in lines if "Error" in line or "error" in line]
            return None, (errors or lines or ["no output"])[-1][:160]
        with open(out_path) as out:
            return json.load(out), ""


def fs_type(path: str) -> str:
    path, best, kind = os.path.realpath(path), "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            _, mount_point, fs = line.split()[:3]
            inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
            if inside and len(mount_point) >= len(best):
                best, kind = mount_point, fs
    return kind


def run_fio(folder: str, jobs: int, size: int) -> dict[str, float] | None:
    """fio's sequential write then read GB/s (all jobs together) on ``folder``, or None."""
    fio = shutil.which("fio")
    if fio is None:
        return None
    rates = {}
    for mode in ("write", "read"):
        done = subprocess.run(
            [fio, "--name=yardstick", f"--directory={folder}", f"--rw={mode}", "--bs=1M",
             f"--size={max(size, 1 << 20)}", "--direct=1", "--ioengine=libaio",
             "--iodepth=8", f"--numjobs={jobs}", "--group_reporting", "--output-format=json"],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            return None
        report = json.loads(done.stdout[done.stdout.index("{") :])
        rates[mode] = report["jobs"][0][mode]["bw_bytes"] / 1e9
    for name in os.listdir(folder):
        if name.startswith("yardstick"):
            os.remove(os.path.join(folder, name))
    return rates


def planned_rows(args) -> list[tuple[int, str, tuple[str, ...]]]:
    """(stage, where, implementations that run it)."""
    rows = [(2, "mem", (OURS, DS)), (2, "cpu", (OURS, DS)), (2, "nvme", (OURS,)),
            (2, "nvme-sdb", (OURS,)), (2, "cpu+dpu", (OURS,)), (3, "mem", (OURS, DS)),
            (3, "cpu", (OURS, DS))]  # fmt: skip
    if 3 in args.stages:
        rows += [(3, "cpu+dpu", (OURS,))]
    rows += [(3, "nvme", (OURS, DS)), (3, "nvme-sdb", (OURS,))]
    if args.param_row:
        rows += [(3, "param", (OURS, DS)), (3, "nvme+pnvme", (OURS, DS))]
    if args.rows:  # the targets need each stage's mem (and cpu for "hidden") rows
        rows = [row for row in rows if row[1] in set(args.rows) | {"mem", "cpu"}]
    return rows


def not_run_by(impl: str, stage: int, where: str) -> str:
    if impl == DS and where in ("cpu+dpu", "nvme-sdb"):
        return "n/a"
    if impl == DS and where == "nvme" and stage < 3:
        return "n/a"
    return "not run"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--params", type=float, default=200e6)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stages", type=int, nargs="+", default=[2], choices=(2, 3))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=64, help="rows per step and rank")
    parser.add_argument("--bucket", type=float, default=1e7, help="reduce_bucket_size")
    parser.add_argument("--sub-group-size", type=float, default=1e7)
    parser.add_argument(
        "--buffer-count",
        type=int,
        default=4,
        help="deepspeed_cpp's buffer_count: swap buffers of a whole sub-group "
        "(fp32 master, both moments and the gradient: 16 bytes per element)",
    )
    parser.add_argument(
        "--ds-buffer-count",
        type=int,
        default=16,
        help="DeepSpeed's buffer_count: it counts one buffer per state tensor "
        "(4 bytes per element), so 4 x --buffer-count holds the same bytes; "
        "with pipeline_read/write its AdamW needs more than 8",
    )
    parser.add_argument("--nvme-path", default="/work/bench_offload_nvme",
                        help="a folder on a real disk (made if missing)")  # fmt: skip
    parser.add_argument("--ds-python", default="/work/ds_venv/bin/python",
                        help="a Python with DeepSpeed installed ('' skips DeepSpeed)")  # fmt: skip
    parser.add_argument("--param-row", action="store_true",
                        help="also the stage-3 offload_param cpu row")  # fmt: skip
    parser.add_argument("--rows", nargs="+", help="only these configs (and mem, cpu), e.g. nvme")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per config")
    args = parser.parse_args()
    if args.worker:
        return worker_main(*args.worker)

    started = time.perf_counter()
    os.makedirs(args.nvme_path, exist_ok=True)
    fs = fs_type(args.nvme_path)
    width, layers = args.width, layer_count(args.params, args.width)
    n_params = layers * (width * width + width)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU")  # fmt: skip
    cores = os.cpu_count() or 1
    rows = planned_rows(args)
    results: dict[tuple, dict] = {}  # (procs, stage, where, impl) -> summary
    notes: list[str] = []
    fio: dict[int, dict | None] = {}
    for procs in args.procs:
        threads = max(1, cores // procs)
        state_per_rank = 12 * n_params / procs
        fio[procs] = run_fio(args.nvme_path, procs, int(state_per_rank))
        for stage, where, impls in rows:
            for impl in impls:
                if impl == DS and not args.ds_python:
                    continue
                folder = tempfile.mkdtemp(prefix="run_", dir=args.nvme_path)
                spec = {"impl": impl, "procs": procs, "threads": threads, "stage": stage,
                        "where": where, "folder": folder, "params": args.params,
                        "width": width, "dtype": args.dtype, "steps": args.steps,
                        "warmup": args.warmup, "micro_batch": args.micro_batch,
                        "bucket": args.bucket, "sub_group_size": args.sub_group_size,
                        "buffer_count": args.buffer_count,
                        "ds_buffer_count": args.ds_buffer_count}  # fmt: skip
                env = dict(os.environ, OMP_NUM_THREADS=str(threads))
                python = sys.executable
                if impl == DS:
                    env["DS_ACCELERATOR"] = "cpu"
                    python = args.ds_python
                began = time.perf_counter()
                reports, why = run_config(spec, python, env, args.timeout)
                shutil.rmtree(folder, ignore_errors=True)
                label = f"{impl} z{stage} {where} x{procs}"
                if reports is None:
                    notes.append(f"{label}: not run: {why}")
                    print(f"  {label}: FAILED ({why})", file=sys.stderr, flush=True)
                    continue
                results[(procs, stage, where, impl)] = summarize(reports)
                print(f"  {label}: {time.perf_counter() - began:.0f} s", file=sys.stderr,
                      flush=True)  # fmt: skip
    print_tables(args, results, notes, fio, rows, n_params, layers, cpu, fs)
    print(f"(run took {time.perf_counter() - started:.0f} s)")


def summarize(reports: list[dict]) -> dict:
    steps = [max(r["steps"][i][0] for r in reports) for i in range(len(reports[0]["steps"]))]
    summary = {
        "step": statistics.median(steps),
        "compute": statistics.median(
            max(r["steps"][i][1] for r in reports) for i in range(len(steps))
        ),  # fmt: skip
        "update": statistics.median(
            max(r["steps"][i][2] for r in reports) for i in range(len(steps))
        ),  # fmt: skip
        "peak_rss": max(r["peak_rss"] for r in reports),
        "start_rss": max(r["start_rss"] for r in reports),
        "trimmed_rss": max(r["trimmed_rss"] for r in reports),
        "written": max(r["written"] for r in reports),
        "read": max(r["read"] for r in reports),
        "io_total": sum(r["written"] + r["read"] for r in reports),
    }
    for key in ("state_bytes", "disk_bytes", "sub_groups", "swap_bytes", "version", "optimizer"):
        if key in reports[0]:
            values = [r[key] for r in reports]
            summary[key] = max(values) if not isinstance(values[0], str) else values[0]
    if "pure_swap_s" in reports[0]:
        summary["pure_swap_s"] = max(r["pure_swap_s"] for r in reports)
        summary["pure_swap_io"] = sum(r["pure_swap_io"] for r in reports)
    return summary


def print_tables(args, results, notes, fio, rows, n_params, layers, cpu, fs) -> None:
    print(f"\n{n_params / 1e6:.1f}M parameters ({layers} x Linear({args.width}, {args.width}) + "
          f"ReLU), {args.dtype}, AdamW, micro-batch {args.micro_batch} rows; CPU: {cpu}, "
          f"{os.cpu_count()} cores (threads per process = cores / processes); step: median of "
          f"{args.steps} after {args.warmup}, slowest rank; NVMe folder {args.nvme_path} "
          f"({fs}); reduce_bucket_size {args.bucket:.0e}, sub_group_size "
          f"{args.sub_group_size:.0e}, buffer_count {args.buffer_count} (DeepSpeed "
          f"{args.ds_buffer_count})")  # fmt: skip
    print(f"deepspeed_cpp's NVMe rows run with glibc's mmap threshold fixed by the engine "
          f"(DS_CPP_MMAP_THRESHOLD={os.environ.get('DS_CPP_MMAP_THRESHOLD', '1 MiB default')}, "
          f"runtime/zero/offload/host_heap.py); the other rows with glibc's default")  # fmt: skip
    versions = {s["version"] + " (" + s["optimizer"] + ")" for k, s in results.items()
                if k[3] == DS and k[2] != "mem"}  # fmt: skip
    if versions:
        print(f"DeepSpeed {', '.join(sorted(versions))} on its CPU accelerator")
    for note in notes:
        print(note)
    header = (f"{'procs':>5} {'config':<11} {'impl':<13} {'step s':>7} {'f+b s':>6} "
              f"{'upd s':>6} {'RSS MiB':>8} {'start':>5} {'trim':>5} {'state MiB':>9} "
              f"{'disk MiB':>8} {'wr MiB':>7} {'rd MiB':>7} {'I/O GB/s':>8} "
              f"{'hidden':>6} {'step/DS':>7} {'RSS/DS':>6}")  # fmt: skip
    targets = []
    for procs in args.procs:
        print("\n" + header)
        state_per_rank = 12 * n_params / procs
        for stage, where, _ in rows:
            for impl in (DS, OURS):
                key = (procs, stage, where, impl)
                config = f"z{stage} {where}"
                if key not in results:
                    why = not_run_by(impl, stage, where)
                    print(f"{procs:>5} {config:<11} {impl:<13} {why}")
                    continue
                s = results[key]
                hidden, ratio_step, ratio_rss = "", "", ""
                if impl == OURS and "pure_swap_s" in s and (procs, stage, "cpu", OURS) in results:
                    compute = results[(procs, stage, "cpu", OURS)]["step"]
                    io = s["pure_swap_s"]
                    hidden = f"{min(1.0, max(0.0, (io + compute - s['step']) / io)):.0%}"
                ds = results.get((procs, stage, where, DS))
                if impl == OURS and ds is not None:
                    ratio_step = f"{s['step'] / ds['step']:.2f}"
                    ratio_rss = f"{s['peak_rss'] / ds['peak_rss']:.2f}"
                io_rate = s["io_total"] / s["step"] / 1e9 if s["io_total"] > 2**20 else 0.0
                print(f"{procs:>5} {config:<11} {impl:<13} {s['step']:7.3f} {s['compute']:6.3f} "
                      f"{s['update']:6.3f} {mib(s['peak_rss']):>8} {mib(s['start_rss']):>5} "
                      f"{mib(s['trimmed_rss']):>5} "
                      f"{mib(s['state_bytes']) if 'state_bytes' in s else '-':>9} "
                      f"{mib(s['disk_bytes']) if 'disk_bytes' in s else '-':>8} "
                      f"{mib(s['written']):>7} {mib(s['read']):>7} "
                      f"{f'{io_rate:.2f}' if io_rate else '-':>8} {hidden:>6} "
                      f"{ratio_step:>7} {ratio_rss:>6}")  # fmt: skip
        rates = fio.get(procs)
        print(f"optimizer state per rank (fp32 masters + exp_avg + exp_avg_sq): "
              f"{mib(state_per_rank)} MiB")  # fmt: skip
        for stage, where in ((2, "nvme"), (3, "nvme"), (2, "nvme-sdb"), (3, "nvme-sdb")):
            nvme = results.get((procs, stage, where, OURS))
            if nvme is None:
                continue
            gbs = nvme["pure_swap_io"] / nvme["pure_swap_s"] / 1e9
            print(f"pure swap z{stage} {where} x{procs}: {nvme['swap_bytes'] / 2**20:.0f} MiB/rank "
                  f"(read + write, {nvme['sub_groups']} sub-groups) in {nvme['pure_swap_s']:.3f} "
                  f"s = {gbs:.2f} GB/s all ranks"
                  + (f"; fio {procs} job(s) on the same folder: write {rates['write']:.2f}, read "
                     f"{rates['read']:.2f} GB/s" if rates else "; fio not available"))  # fmt: skip
            memory = results.get((procs, stage, "mem", OURS))
            if memory is not None:
                bound = 1.2 * max(memory["step"], nvme["pure_swap_s"])
                targets.append((f"(1) z{stage} x{procs} {where} step {nvme['step']:.3f} s <= 1.2 x "
                                f"max(mem {memory['step']:.3f}, pure I/O "
                                f"{nvme['pure_swap_s']:.3f}) = {bound:.3f} s",
                                nvme["step"] <= bound))  # fmt: skip
                limit = memory["peak_rss"] - 0.8 * state_per_rank
                targets.append((f"(2) z{stage} x{procs} {where} RSS {mib(nvme['peak_rss'])} MiB <= "
                                f"mem {mib(memory['peak_rss'])} - 0.8 x {mib(state_per_rank)} = "
                                f"{mib(limit)} MiB", nvme["peak_rss"] <= limit))  # fmt: skip
        for stage, where, _ in rows:
            ours, ds = (
                results.get((procs, stage, where, OURS)),
                results.get((procs, stage, where, DS)),
            )
            if ours and ds:
                targets.append((f"(3) z{stage} {where} x{procs}: ours/DeepSpeed step "
                                f"{ours['step'] / ds['step']:.2f} < 1",
                                ours["step"] < ds["step"]))  # fmt: skip
    print("\nTargets")
    for text, passed in targets:
        print(f"  {'PASS' if passed else 'FAIL'}  {text}")


if __name__ == "__main__":
    main()
