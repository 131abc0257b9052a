"""What the comms logger costs: ZeRO-2 and ZeRO-3 step time on 2 gloo ranks with the logger off
and on, beside a checkout without the logger (``--reference``, e.g. the main branch).

    PYTHONPATH=$PWD python benchmarks/bench_comms_logger.py --reference /work/main

Each configuration runs in a fresh pair of processes (its own PYTHONPATH); the step time is the
median over ``--steps`` steps after ``--warmup``, the slower rank's. Off must match the reference
within noise: off, nothing is wrapped (``deepspeed_cpp/comm/comms_logger.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _worker(rank: int, stage: int, logger: bool, steps: int, warmup: int) -> float:
    import torch

    import deepspeed_cpp as deepspeed

    torch.set_num_threads(1)
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 2_000_000},
        "comms_logger": {"enabled": logger},
    }
    torch.manual_seed(0)
    layers = []
    for _ in range(8):
        layers += [torch.nn.Linear(512, 512), torch.nn.ReLU()]
    engine, _, _, _ = deepspeed.initialize(model=torch.nn.Sequential(*layers), config=config)
    x = torch.randn(8, 512)
    times = []
    for step in range(warmup + steps):
        start = time.perf_counter()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _measure(pythonpath: str, stage: int, logger: bool, steps: int, warmup: int) -> float:
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import json;"
        "import bench_comms_logger as b, gloo_ranks as g;"
        f"print(json.dumps(max(g.run_on_ranks(2, b._worker, {stage}, {logger}, {steps}, "
        f"{warmup}))))"
    )
    env = dict(os.environ, PYTHONPATH=pythonpath)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _hooks_off_us(iterations: int = 20000) -> float:
    """Microseconds per step of what the engine adds to a step with every report off (the
    monitor, timer and profiler hooks; the comms logger adds none): measured in one process,
    where a shared host's noise cannot hide it as it does in the step times."""
    import time as clock

    import torch

    from deepspeed_cpp.runtime.config import DeepSpeedConfig
    from deepspeed_cpp.runtime.training_report import TrainingReport

    class Engine:  # what TrainingReport reads of the engine
        global_steps = global_samples = 0

    report, engine, loss = TrainingReport(DeepSpeedConfig.parse({}), 0), Engine(), torch.ones(())
    start = clock.perf_counter()
    for _ in range(iterations):
        report.before_forward(engine)
        report.after_forward(engine)
        report.begin("bwd"), report.begin("bwd_inner"), report.end("bwd_inner")
        report.begin("bwd_allreduce"), report.end("bwd_allreduce"), report.end("bwd")
        report.after_backward(loss, 1, True, 0)
        profiled = report.before_step(engine)
        report.begin("step"), report.end("step")
        report.after_step(engine, True, profiled)
    return (clock.perf_counter() - start) / iterations * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", required=True, help="checkout without the comms logger")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    ours = str(HERE.parent)
    print(f"{'stage':<6}{'reference (ms)':>16}{'logger off (ms)':>17}{'off/ref':>9}"
          f"{'logger on (ms)':>16}{'on/ref':>8}")  # fmt: skip
    for stage in (2, 3):
        rows = {"ref": [], "off": [], "on": []}
        for _ in range(args.repeats):  # interleaved, so that drift on a shared host hits all
            rows["ref"].append(_measure(args.reference, stage, False, args.steps, args.warmup))
            rows["off"].append(_measure(ours, stage, False, args.steps, args.warmup))
            rows["on"].append(_measure(ours, stage, True, args.steps, args.warmup))
        ref, off, on = (min(rows[k]) for k in ("ref", "off", "on"))
        print(f"{stage:<6}{ref:>16.2f}{off:>17.2f}{off / ref:>9.3f}{on:>16.2f}{on / ref:>8.3f}")
    print(f"engine hooks with every report off: {_hooks_off_us():.2f} us per step")


if __name__ == "__main__":
    main()
