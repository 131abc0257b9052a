"""Cold just-in-time build time of the op libraries: what a first use costs on a fresh machine.

Each family named is compiled into a fresh, empty extension cache (a temporary folder, removed
afterwards), one after the other, MAX_JOBS compile jobs each (2 unless set); the wall-clock time
of each build, each translation unit's compile time within it (from ninja's own log: MAX_JOBS
units compile at once, so a unit's time includes sharing the cores) and the compilers' CPU time
of all of them are printed. An op's first build also builds the schema library it registers
through, inside the first op's time. Run it in two checkouts
(a ``git worktree`` of the older commit) one after the other to compare their sources' headers:

    python benchmarks/bench_op_build.py [--ops zero moe fused_adam_host aio]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

# This checkout's sources, not the deepspeed_cpp the environment has installed (an editable
# install points at one checkout; comparing two needs each to build its own).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUILDERS = {
    "zero": "ZeroBuilder",
    "moe": "MoEBuilder",
    "fused_adam_host": "FusedAdamHostBuilder",
    "aio": "AsyncIOBuilder",
    "cpu_adam": "CPUAdamBuilder",
}


def unit_times(cache: str, name: str) -> list[tuple[str, float]]:
    """Each object file of op ``name``'s build and its compile time in seconds, from the
    ``.ninja_log`` of its build folder (start and end in milliseconds on each line)."""
    (log,) = Path(cache).glob(f"*/{name}_*/.ninja_log")
    units = []
    for line in log.read_text().splitlines():
        if line.startswith("#"):
            continue
        start, end, _, output, _ = line.split("\t")
        if output.endswith(".o"):
            units.append((output, (int(end) - int(start)) / 1000))
    return units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="+", choices=sorted(BUILDERS), default=list(BUILDERS)[:4])
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="ds_bench_op_build_")
    os.environ["DS_CPP_EXTENSIONS_DIR"] = cache
    os.environ.setdefault("MAX_JOBS", "2")
    from deepspeed_cpp.ops import op_builder

    print(f"sources: {op_builder.builder.csrc_dir()}")

    try:
        total = 0.0
        for name in args.ops:
            start = time.perf_counter()
            getattr(op_builder, BUILDERS[name])().load()
            elapsed = time.perf_counter() - start
            total += elapsed
            print(f"{name:<16} {elapsed:6.1f} s wall", flush=True)
            for unit, seconds in unit_times(cache, name):
                print(f"  {unit:<28} {seconds:6.1f} s")
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        print(f"{'all':<16} {total:6.1f} s wall, compilers {children.ru_utime:.1f} s CPU")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
