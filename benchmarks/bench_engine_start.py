"""Engine start: ``deepspeed_cpp.initialize`` in a fresh process, with torch's
``Optimizer.add_param_group`` (whose wrapper imports torch._dynamo at its first call: the
reference, what every construction of one of our optimizers paid before optimizer_base.py) and
with ours (deepspeed_cpp/optim/optimizer_base.py), in the same run.

Each repetition is a fresh interpreter (world of one, gloo) that times ``initialize`` of a
3-layer model at ZeRO stage 2 and says whether torch._dynamo got imported; the table gives the
median over the repetitions, taken in turns.

    python benchmarks/bench_engine_start.py [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, os, sys, time
import torch
from deepspeed_cpp.optim.optimizer_base import OptimizerBase
import deepspeed_cpp
if sys.argv[1] == "torch":
    OptimizerBase.add_param_group = torch.optim.Optimizer.add_param_group
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
start = time.perf_counter()
deepspeed_cpp.initialize(model=model, config={
    "train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    "zero_optimization": {"stage": 2}})
print(json.dumps([time.perf_counter() - start, "torch._dynamo" in sys.modules]))
"""

MODES = {"torch": "torch's add_param_group (reference)", "ours": "OptimizerBase (deepspeed_cpp)"}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(mode: str) -> tuple[float, bool]:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), PYTHONPATH=str(ROOT))  # fmt: skip
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    seconds, dynamo = json.loads(done.stdout.strip().splitlines()[-1])
    return seconds, dynamo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    results: dict[str, list[tuple[float, bool]]] = {mode: [] for mode in MODES}
    for _ in range(args.reps):
        for mode in MODES:
            results[mode].append(_run(mode))
    print(f"deepspeed_cpp.initialize in a fresh process, median of {args.reps}")
    print(f"{'add_param_group':40s} {'seconds':>8s}  torch._dynamo imported")
    medians = {}
    for mode, label in MODES.items():
        medians[mode] = statistics.median(seconds for seconds, _ in results[mode])
        imported = sorted({dynamo for _, dynamo in results[mode]})
        print(f"{label:40s} {medians[mode]:8.3f}  {imported}")
    print(f"{'ours / reference':40s} {medians['ours'] / medians['torch']:8.3f}")


if __name__ == "__main__":
    main()
