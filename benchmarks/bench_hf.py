"""The Hugging Face Trainer on deepspeed_cpp (ZeRO-2) beside the stock Trainer with DDP and, when a
Python with DeepSpeed is given, the stock Trainer with real DeepSpeed ZeRO-2.

A GPT-2 sized up to ~50M parameters from a ``GPT2Config`` (no downloads), the same seeded token
data, the Trainer's own AdamW, N processes on the CPU (gloo), ``--steps`` optimizer steps each.
Every implementation is started through torchrun as its own job (this file, ``--worker``), one
after the other; each rank records the wall time at every ``on_step_end`` and its peak RSS.
Printed: median step time after ``--warmup`` steps, the ratio to stock DDP, peak RSS per rank (the
largest rank), and the first/last loss (ours and DDP see the same batches, so they should agree).

    python benchmarks/bench_hf.py [--procs 2] [--steps 20] [--deepspeed-python PYTHON]

The DeepSpeed job needs transformers and accelerate in that Python too (the same versions), and
runs with ``DS_ACCELERATOR=cpu``. accelerate 1.15 picks no process-group backend for its
DeepSpeed mode on a machine without a GPU (each rank would count a world of one, and DeepSpeed
would reject the batch sizes), so for that job the worker makes accelerate choose gloo, which
is what its CPU path would choose; nothing else of the stock path is changed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, LAYERS, HEADS, VOCAB, SEQ = 512, 12, 8, 24576, 64
MICRO_BATCH, LR, BUCKET = 2, 1e-4, 5e6
JOBS = ("ddp", "ours", "deepspeed")
TITLES = {
    "ddp": "stock Trainer + DDP (gloo)",
    "ours": "deepspeed_cpp.hf Trainer, ZeRO-2",
    "deepspeed": "stock Trainer + DeepSpeed ZeRO-2",
}


def ds_config() -> dict:
    # The same ZeRO-2 config for our engine and for DeepSpeed: buckets near DDP's 25 MB (on the
    # CPU, DeepSpeed's 5e8 default would leave nothing to overlap), the rest "auto".
    return {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": BUCKET,
            "allgather_bucket_size": BUCKET,
            "overlap_comm": True,
            "contiguous_gradients": True,
        },
    }


# --- the worker: one rank of one job, started by torchrun ------------------------------------


def _use_gloo_for_accelerate_deepspeed() -> None:
    """accelerate 1.15 leaves its DeepSpeed mode without a backend on a machine without a GPU
    (world of one per rank); make it choose gloo, as its CPU path does."""
    import torch
    from accelerate.state import DistributedType, PartialState

    if torch.cuda.is_available():
        return
    chosen = PartialState._prepare_backend

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        picked, kind = chosen(self, cpu, sagemaker_dp, backend)
        if picked is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return "gloo", DistributedType.MULTI_CPU
        return picked, kind

    PartialState._prepare_backend = prepare_backend


def worker(job: str, steps: int, out_dir: str) -> None:
    import torch
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback

    if job == "ours":
        from deepspeed_cpp.hf import Trainer, TrainingArguments
    else:
        from transformers import Trainer, TrainingArguments
    if job == "deepspeed":
        _use_gloo_for_accelerate_deepspeed()

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(1234)
    model = GPT2LMHeadModel(config)
    world = int(os.environ["WORLD_SIZE"])
    tokens = torch.randint(
        0, VOCAB, (steps * MICRO_BATCH * world, SEQ), generator=torch.Generator().manual_seed(7)
    )
    dataset = [{"input_ids": row, "labels": row} for row in tokens]
    arguments = {
        "output_dir": os.path.join(out_dir, job),
        "per_device_train_batch_size": MICRO_BATCH,
        "max_steps": steps,
        "learning_rate": LR,
        "optim": "adamw_torch",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "dataloader_pin_memory": False,
        "ddp_backend": "gloo",
    }
    if job == "ddp":
        # On a machine without a GPU the stock Trainer runs DDP only when asked for the CPU.
        arguments["use_cpu"] = not torch.cuda.is_available()
    else:
        arguments["deepspeed"] = ds_config()
    args = TrainingArguments(**arguments)

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    clock = StepClock()
    trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=[clock])
    start = time.perf_counter()
    trainer.train()
    report = {
        "rank": int(os.environ["RANK"]),
        "world": args.world_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "step_ends": [start, *clock.times],
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    if job == "deepspeed":
        import deepspeed

        report["versions"]["deepspeed"] = deepspeed.__version__
    with open(os.path.join(out_dir, f"{job}_rank{report['rank']}.json"), "w") as handle:
        json.dump(report, handle)


# --- the driver --------------------------------------------------------------------------------


def run_job(job: str, python: str, procs: int, steps: int, out_dir: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    repo = str(Path(__file__).resolve().parents[1])
    if job == "deepspeed":
        env["DS_ACCELERATOR"] = "cpu"
        # That Python has its own torch; our package must not shadow anything there.
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    command = [
        python, "-m", "torch.distributed.run", f"--nproc_per_node={procs}",
        f"--master_port={_free_port()}",
        __file__, "--worker", job, "--steps", str(steps), "--out", str(out_dir),
    ]  # fmt: skip
    run = subprocess.run(command, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{job} failed (rc {run.returncode}):\n{run.stderr[-6000:]}")
    return [json.loads((out_dir / f"{job}_rank{r}.json").read_text()) for r in range(procs)]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def summarize(reports: list[dict], warmup: int) -> dict:
    # A step ends when the slowest rank's step ends; per step, the rank-0 clock is enough
    # (every step ends in a collective), and the median after warm-up is what we compare.
    ends = reports[0]["step_ends"]
    durations = [b - a for a, b in zip(ends, ends[1:])][warmup:]
    return {
        "median_s": statistics.median(durations),
        "peak_rss": max(r["peak_rss_bytes"] for r in reports),
        "losses": reports[0]["losses"],
        "world": reports[0]["world"],
        "parameters": reports[0]["parameters"],
        "versions": reports[0]["versions"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument(
        "--deepspeed-python", default="/work/ds_venv/bin/python",
        help="a Python with deepspeed, transformers and accelerate (skipped when absent)",
    )  # fmt: skip
    parser.add_argument("--worker", choices=JOBS, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")

    pythons = {"ddp": sys.executable, "ours": sys.executable}
    probe = [args.deepspeed_python, "-c", "import deepspeed, transformers, accelerate"]
    if shutil.which(args.deepspeed_python) and subprocess.run(probe).returncode == 0:
        pythons["deepspeed"] = args.deepspeed_python
    else:
        print(f"(no DeepSpeed job: {args.deepspeed_python} cannot import deepspeed/transformers)")

    out_dir = Path(tempfile.mkdtemp(prefix="bench_hf_"))
    results = {}
    for job, python in pythons.items():
        results[job] = summarize(run_job(job, python, args.procs, args.steps, out_dir), args.warmup)
    shutil.rmtree(out_dir, ignore_errors=True)

    first = results["ddp"]
    print(
        f"GPT-2 from a config: {first['parameters'] / 1e6:.1f}M parameters (hidden {HIDDEN}, "
        f"{LAYERS} layers, vocab {VOCAB}), sequence {SEQ}, micro batch {MICRO_BATCH} per rank, "
        f"{args.procs} processes on the CPU (gloo, 1 thread each), {args.steps} steps, median of "
        f"the last {args.steps - args.warmup}"
    )
    reference = first["median_s"]
    header = f"{'implementation':<36}{'world':>6}{'step (s)':>10}{'vs DDP':>8}{'peak RSS/rank':>15}"
    print(header + f"{'loss first/last':>20}")
    for job, result in results.items():
        losses = result["losses"]
        print(
            f"{TITLES[job]:<36}{result['world']:>6}{result['median_s']:>10.3f}"
            f"{result['median_s'] / reference:>7.2f}x{result['peak_rss'] / 2**20:>11.0f} MiB"
            f"{losses[0]:>10.4f}/{losses[-1]:.4f}"
        )
    if "deepspeed" in results and "ours" in results:
        ratio = results["ours"]["median_s"] / results["deepspeed"]["median_s"]
        print(f"ours / real DeepSpeed step time: {ratio:.2f}x")
    for job, result in results.items():
        print(f"  {job}: {result['versions']}")


if __name__ == "__main__":
    main()
