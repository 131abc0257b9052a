"""Memory and time of consolidating a ZeRO checkpoint into one fp32 state_dict.

Saves a ZeRO-2 checkpoint of a model of a few hundred MB from 2 gloo processes, then, in fresh
processes, interleaved, measures how far resident memory rises above the imports (Linux: the
peak is reset after importing, see MEASURE) and the wall time of:

- reference: what a straightforward consolidator does (and what DeepSpeed's zero_to_fp32 does
  with its own files): load every shard file whole, put the masters together, save;
- ours: ``python -m deepspeed_cpp.utils.zero_to_fp32 CHECKPOINT OUTPUT`` (memory-mapped shards,
  one at a time, copied straight into the output).

The floor is the output itself: a consolidator has to hold it (or stream it to disk).

    python benchmarks/bench_zero_to_fp32.py [--params-millions 75] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

WIDTH = 2048

MEASURE = """
import sys, time
{imports}

def status_bytes(key):
    with open("/proc/self/status") as status:
        return next(int(l.split()[1]) * 1024 for l in status if l.startswith(key))

with open("/proc/self/clear_refs", "w") as clear_refs:
    clear_refs.write("5")
before = status_bytes("VmRSS:")
start = time.perf_counter()
{work}
print("result", status_bytes("VmHWM:") - before, time.perf_counter() - start)
"""

OURS = dict(
    imports="from deepspeed_cpp.utils import zero_to_fp32",
    work="assert zero_to_fp32.main(sys.argv[1:]) == 0",
)

# Everything loaded at once, then the masters cut out by the same metadata.
REFERENCE = dict(
    imports="import json, torch\nfrom pathlib import Path",
    work="""
directory = Path(sys.argv[1]) / Path(sys.argv[1], "latest").read_text()
meta = json.loads((directory / "checkpoint_meta.json").read_text())
files = {f["name"]: torch.load(directory / f["name"], map_location="cpu", weights_only=True)
         for f in meta["files"] if f["name"].endswith("optim_states.pt")}
module = torch.load(directory / "mp_rank_00_model_states.pt", map_location="cpu",
                    weights_only=True)["module"]
layout = meta["zero_layout"]
fulls = [torch.cat([files[s["file"]]["buckets"][b]["master"] for s in bucket["slices"]])
         for b, bucket in enumerate(layout["buckets"])]
state = dict(module)
for p in layout["params"]:
    value = fulls[p["bucket"]][p["offset"]:p["offset"] + p["numel"]].view(p["shape"]).clone()
    for name in p["names"]:
        state[name] = value
torch.save(state, sys.argv[2])
""",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _save_worker(rank: int, world: int, port: int, directory: str, layers: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    import deepspeed_cpp as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    config = {"train_batch_size": world, "steps_per_print": 1000,
              "zero_optimization": {"stage": 2, "reduce_bucket_size": 50_000_000},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}  # fmt: skip
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.backward(engine(torch.randn(1, WIDTH)).square().mean())
    engine.step()
    engine.save_checkpoint(directory)


def _measure(kind: dict, checkpoint: Path, output: Path) -> tuple[int, float]:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE.format(**kind), str(checkpoint), str(output)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    rise, seconds = done.stdout.split("result")[-1].split()
    return int(rise), float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-millions", type=float, default=75.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    layers = max(1, round(args.params_millions * 1e6 / (WIDTH * WIDTH + WIDTH)))
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        checkpoint, output = Path(work) / "checkpoints", Path(work) / "out.bin"
        started = time.perf_counter()
        mp.start_processes(_save_worker, args=(2, _free_port(), str(checkpoint), layers),
                           nprocs=2, start_method="spawn")  # fmt: skip
        tag_dir = checkpoint / (checkpoint / "latest").read_text()
        checkpoint_bytes = sum(f.stat().st_size for f in tag_dir.iterdir())
        elapsed = time.perf_counter() - started
        print(
            f"saved a 2-rank ZeRO-2 checkpoint of {layers} x Linear({WIDTH}, {WIDTH}) "
            f"({checkpoint_bytes / 2**20:.0f} MiB) in {elapsed:.1f} s"
        )
        results: dict[str, list[tuple[int, float]]] = {"reference": [], "ours": []}
        for _ in range(args.repeats):  # interleaved
            results["reference"].append(_measure(REFERENCE, checkpoint, output))
            reference_size = output.stat().st_size
            results["ours"].append(_measure(OURS, checkpoint, output))
        size = output.stat().st_size
        assert size > 0.95 * reference_size
    print(f"\noutput: {size / 2**20:.0f} MiB (fp32 state_dict); median of {args.repeats}")
    print(f"{'consolidator':<34}{'peak RSS rise MiB':>18}{'x output':>10}{'seconds':>10}")
    medians = {}
    for name, label in (("reference", "load all shards, then save"),
                        ("ours", "zero_to_fp32 (mmap, one shard)")):  # fmt: skip
        rise = statistics.median(r for r, _ in results[name])
        seconds = statistics.median(s for _, s in results[name])
        medians[name] = (rise, seconds)
        print(f"{label:<34}{rise / 2**20:>18.0f}{rise / size:>10.2f}{seconds:>10.2f}")
    print(f"{'ours / reference':<34}{medians['ours'][0] / medians['reference'][0]:>18.2f}"
          f"{'':>10}{medians['ours'][1] / medians['reference'][1]:>10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
