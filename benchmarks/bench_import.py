"""Import time: ``import torch`` alone, then ``import deepspeed_cpp`` on top, and DeepSpeed's.

Each repetition is a fresh interpreter that times its own imports with ``time.perf_counter``
(interpreter start-up is left out; it is the same with or without the package). The table gives
the median over the repetitions: torch alone, torch + the package, and the difference, which is
what the package costs a user who already imports torch. DeepSpeed's row needs an interpreter
that has it (``--deepspeed-python``, default /work/ds_venv/bin/python, run with
DS_ACCELERATOR=cpu); without one the row says so.

    python benchmarks/bench_import.py [--reps 7] [--deepspeed-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Printed by the child: seconds for `import torch`, then for the package on top of it.
_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
middle = time.perf_counter()
__import__(sys.argv[1])
end = time.perf_counter()
print(json.dumps([middle - start, end - middle]))
"""


def measure(python: str, package: str, reps: int, env: dict[str, str]) -> tuple[float, float]:
    """Median seconds of (import torch, import package after torch) over `reps` processes."""
    torch_times, package_times = [], []
    for _ in range(reps):
        out = subprocess.run(
            [python, "-c", _CHILD, package], env=env, capture_output=True, text=True, check=True
        )
        torch_s, package_s = json.loads(out.stdout.strip().splitlines()[-1])
        torch_times.append(torch_s)
        package_times.append(package_s)
    return statistics.median(torch_times), statistics.median(package_times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--deepspeed-python", default="/work/ds_venv/bin/python")
    args = parser.parse_args()

    ours_env = dict(os.environ)
    ours_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    rows = [("deepspeed_cpp", *measure(sys.executable, "deepspeed_cpp", args.reps, ours_env))]
    reference = "DeepSpeed (DS_ACCELERATOR=cpu)"
    if Path(args.deepspeed_python).is_file():
        ds_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        ds_env["DS_ACCELERATOR"] = "cpu"
        try:
            rows.append(
                (reference, *measure(args.deepspeed_python, "deepspeed", args.reps, ds_env))
            )
        except subprocess.CalledProcessError as error:
            last = (error.stderr.strip().splitlines() or ["?"])[-1]
            print(f"{reference}: import failed: {last}")
    else:
        print(f"{reference}: no interpreter at {args.deepspeed_python}; row left out")

    print(f"import time, median of {args.reps} fresh processes ({os.cpu_count()} cores)")
    print(f"{'package':<32}{'torch alone':>14}{'torch + pkg':>14}{'difference':>14}")
    for name, torch_s, package_s in rows:
        total = torch_s + package_s
        print(f"{name:<32}{torch_s:>13.3f}s{total:>13.3f}s{package_s:>13.3f}s")
    if len(rows) == 2:
        print(f"deepspeed_cpp's cost / DeepSpeed's: {rows[0][2] / rows[1][2]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
