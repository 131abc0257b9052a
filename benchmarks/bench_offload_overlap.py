"""NVMe optimizer offload: how much of the swap I/O the step hides, with and without
``offload_optimizer.step_during_backward`` (deepspeed_cpp's extension, on by default for NVMe
where nothing excludes it), against issue 12's
target (1): NVMe step <= 1.2 x max(in-memory step, pure swap I/O time).

One launch of ``--procs`` gloo processes builds three engines on the same model and config
(bench_offload.py's model and ds_config: ``Linear(width, width) + ReLU`` blocks, AdamW, one
micro-batch of random rows, loss = mean(out^2)):

  mem        in-memory ZeRO-2 (the reference)
  nvme-sdb   offload_optimizer nvme, pipeline_read/pipeline_write, ``--buffer-count`` buffers,
             step_during_backward false: every sub-group is swapped and stepped in engine.step()
             (DeepSpeed's schedule)
  nvme       the same config with the key unset (the default): each sub-group is stepped inside
             backward as soon as its buckets are reduced, so its reads and writes overlap the
             rest of backward

and times them interleaved: ``--rounds`` rounds, each running every engine for one untimed step
(swap reads left in flight by the engine before, which would overlap this one's compute, land
there) and then ``--steps`` timed steps, each from barrier to barrier. Times are medians over all
timed steps. Pure swap I/O: after the steps, in the same processes, every sub-group of the nvme
engine is read into the same buffers and written back through its own swap files and aio
handles, up to one transfer per buffer in flight (bench_offload.pure_swap_seconds): the time the
disk needs for a step's bytes with nothing else to do.

The machine is shared: print the load average with every figure (the script does), and compare
only the ratios printed in one run.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_offload_overlap.py \
        [--params 30e6] [--width 1024] [--procs 1] [--rounds 3] [--steps 3] \
        [--bucket 1e6] [--sub-group-size 3e6] [--buffer-count 4] [--nvme-path DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist
from bench_offload import OURS, ds_config, layer_count, make_model, pure_swap_seconds
from gloo_ranks import run_on_ranks

ROWS = ("mem", "nvme-sdb", "nvme")


def engine_for(row: str, spec: dict):
    import deepspeed_cpp

    where = "mem" if row == "mem" else "nvme"
    folder = os.path.join(spec["folder"], row)
    os.makedirs(folder, exist_ok=True)
    config = ds_config({**spec, "impl": OURS, "stage": spec["stage"], "where": where,
                        "folder": folder})  # fmt: skip
    if row == "nvme-sdb":
        config["zero_optimization"]["offload_optimizer"]["step_during_backward"] = False
    model = make_model(spec["params"], spec["width"])
    engine, *_ = deepspeed_cpp.initialize(model=model, config=config)
    return engine


def rank_worker(rank: int, spec: dict) -> dict:
    torch.set_num_threads(spec["threads"])
    engines = {row: engine_for(row, spec) for row in ROWS}
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(100 + rank)
    batch = torch.randn(spec["micro_batch"], spec["width"], generator=generator).to(dtype)

    def step(engine) -> tuple[float, float, float]:
        dist.barrier()
        start = time.perf_counter()
        engine.backward(engine(batch).float().pow(2).mean())
        middle = time.perf_counter()
        engine.step()
        end = time.perf_counter()
        dist.barrier()
        return time.perf_counter() - start, middle - start, end - middle

    times: dict[str, list] = {row: [] for row in ROWS}
    for _ in range(spec["rounds"]):
        for row, engine in engines.items():
            step(engine)  # untimed: see the module docstring
            times[row] += [step(engine) for _ in range(spec["steps"])]
    home = engines["nvme"].optimizer.home
    result = {
        "times": times,
        "pure_swap_s": pure_swap_seconds(home, repeats=3),
        "sub_groups": len(home.sub_groups),
        "swap_bytes": 2 * sum(home._layout[g][2] for g in range(len(home.sub_groups))) * 4,
    }
    for engine in engines.values():
        engine.destroy()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=30e6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--procs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per engine and round")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--bucket", type=float, default=1e6, help="reduce_bucket_size")
    parser.add_argument("--sub-group-size", type=float, default=3e6)
    parser.add_argument("--buffer-count", type=int, default=4)
    parser.add_argument("--nvme-path", default="/work/bench_offload_nvme",
                        help="a folder on a real disk (made if missing)")  # fmt: skip
    args = parser.parse_args()

    folder = os.path.join(args.nvme_path, f"overlap_{os.getpid()}")
    os.makedirs(folder)
    layers = layer_count(args.params, args.width)
    spec = {"params": args.params, "width": args.width, "dtype": args.dtype, "stage": args.stage,
            "threads": args.threads, "rounds": args.rounds, "steps": args.steps,
            "micro_batch": args.micro_batch, "bucket": args.bucket,
            "sub_group_size": args.sub_group_size, "buffer_count": args.buffer_count,
            "folder": folder}  # fmt: skip
    load_before = os.getloadavg()
    started = time.perf_counter()
    try:
        reports = run_on_ranks(args.procs, rank_worker, spec)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    load_after = os.getloadavg()

    # A step is as slow as its slowest rank: the max over ranks, then the median over steps.
    def median(row: str, column: int) -> float:
        per_step = zip(*(report["times"][row] for report in reports))
        return statistics.median(max(step[column] for step in ranks) for ranks in per_step)

    io = max(report["pure_swap_s"] for report in reports)
    mem = median("mem", 0)
    bound = max(mem, io)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                if line.startswith("model name")), "unknown CPU")  # fmt: skip
    n_params = layers * (args.width * args.width + args.width)
    print(f"{n_params / 1e6:.1f}M parameters ({layers} x Linear({args.width})), {args.dtype}, "
          f"ZeRO-{args.stage}, {args.procs} process(es) x {args.threads} thread(s), micro-batch "
          f"{args.micro_batch}, reduce_bucket_size {args.bucket:.0e}, sub_group_size "
          f"{args.sub_group_size:.0e} ({reports[0]['sub_groups']} sub-groups per rank), "
          f"buffer_count {args.buffer_count}; {cpu}; {os.cpu_count()} cores")  # fmt: skip
    print(f"swap bytes per step and rank {reports[0]['swap_bytes'] / 2**20:.0f} MiB; "
          f"{args.rounds} rounds x {args.steps} timed steps per engine; load average "
          f"{load_before[0]:.2f} before, {load_after[0]:.2f} after (shared machine)")  # fmt: skip
    print()
    print("| row | step s | f+b s | engine.step s | step / max(mem, io) |")
    print("|---|---|---|---|---|")
    print(f"| pure swap I/O (io) | {io:.3f} | | | |")
    for row in ROWS:
        step, fb, update = median(row, 0), median(row, 1), median(row, 2)
        print(f"| {row} | {step:.3f} | {fb:.3f} | {update:.3f} | {step / bound:.2f} |")
    print()
    for row in ("nvme-sdb", "nvme"):
        ratio = median(row, 0) / bound
        verdict = "PASS" if ratio <= 1.2 else "FAIL"
        print(f"target (1) {row}: step / max(mem {mem:.3f} s, io {io:.3f} s) = {ratio:.2f} "
              f"(<= 1.2: {verdict})")  # fmt: skip
    print(f"nvme / nvme-sdb step: {median('nvme', 0) / median('nvme-sdb', 0):.2f}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
