"""``python -m deepspeed_cpp.env_report``: versions, CPU features and the state of every op.

For each op it says whether it is pre-built for this torch, can be compiled just in time, or
cannot be built here and why. Ops that are already built are loaded and report what they say about
themselves (the CPU ISA level in use); ``--load`` compiles the others first (CUDA ops only where
a GPU is visible, or with ``DS_BUILD_<OP>=1``). Without ``--load`` nothing is compiled, as with
DeepSpeed's ``ds_report``: ops the job uses are compiled on first use. ``--timings`` compiles
every op that can be built here into a new, empty cache folder, one fresh process per op, and
prints how long each JIT build took on this machine (MAX_JOBS is honoured).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .ops.op_builder import ALL_OPS, OpNotAvailableError
from .ops.op_builder.build_info import read_build_info
from .ops.op_builder.builder import BUILD_INFO_FILE, default_max_jobs, jit_cache_root

_CPU_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16",
                 "avx512_fp16", "amx_bf16", "asimd", "sve")  # fmt: skip


def cpu_features() -> list[str]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    present = set(line.split(":", 1)[1].split())
                    return [f for f in _CPU_FEATURES if f in present]
    except OSError:
        pass
    return []


def nvcc_version() -> str:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        return "not found"
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"error: {error}"
    release = [line for line in out.stdout.splitlines() if "release" in line]
    return f"{release[-1].strip() if release else out.stdout.strip()} ({nvcc})"


def op_status(builder) -> str:
    compatible, why = builder.is_compatible()
    if not compatible:
        return f"cannot build here: {why}"
    prebuilt, stale = builder.find_prebuilt()
    if prebuilt is not None:
        record = read_build_info(BUILD_INFO_FILE)
        if builder.NAME in record.get("stable_abi_ops", []):
            minimum = record.get("stable_abi_min_torch")
            return f"pre-built ({prebuilt.name}, stable ABI: any torch >= {minimum})"
        return f"pre-built ({prebuilt.name})"
    not_prebuilt = f"pre-built library unusable ({stale})" if stale else "not pre-built"
    cached = builder.jit_build_dir() / f"{builder.jit_build_dir().name}.so"
    if cached.is_file():
        return (
            f"{not_prebuilt}, compiled in the JIT cache"
            if stale
            else "can JIT (already compiled in cache)"
        )
    jit_ok, jit_why = builder.jit_available()
    if not jit_ok:
        return f"{not_prebuilt}, cannot JIT: {jit_why}"
    return f"{not_prebuilt}, can JIT (not compiled)" if stale else "can JIT (not compiled)"


def cuda_build_declined(builder) -> str:
    """Why ``--load`` leaves a CUDA op alone: compiling it with nvcc takes minutes, and on a
    machine without a GPU nothing would run it. ``DS_BUILD_<OP>=1`` asks for it anyway (building
    for another machine). Empty: load it."""
    if not builder.is_cuda() or torch.cuda.is_available():
        return ""
    flag = f"DS_BUILD_{builder.NAME.upper()}"
    if os.environ.get(flag) == "1":
        return ""
    return f"not loaded: a CUDA op and no GPU is visible (set {flag}=1 to build it anyway)"


def loaded_details(name: str) -> str:
    if name == "cpu_adam":
        from .ops.cpu_adam import cpu_adam_isa

        return f"cpu isa level: {cpu_adam_isa()}"
    if name == "aio":
        from .ops.aio import compiled_engines, default_engine

        return f"engine in use: {default_engine()} (compiled in: {', '.join(compiled_engines())})"
    if name == "cpu_adagrad":
        from .ops.cpu_adagrad import cpu_adagrad_isa

        return f"cpu isa level: {cpu_adagrad_isa()}"
    if name == "cpu_lion":
        from .ops.cpu_lion import cpu_lion_isa

        return f"cpu isa level: {cpu_lion_isa()}"
    return ""


def jit_build_timings(ops: list[str]) -> list[tuple[str, str]]:
    """(op, seconds or why not) for a JIT build of each of `ops` from nothing, registry first.

    Each build runs in its own process with DS_CPP_EXTENSIONS_DIR pointing at a temporary folder,
    so nothing already compiled is reused and this process loads nothing. The schema library
    (registry) is built first and is then shared, as it is in real use.
    """
    rows = []
    with tempfile.TemporaryDirectory(prefix="deepspeed_cpp_timings_") as cache:
        env = dict(os.environ, DS_CPP_EXTENSIONS_DIR=cache)
        for name in ["registry", *ops]:
            if name != "registry":
                if name not in ALL_OPS:
                    rows.append((name, f"no such op (known: {', '.join(ALL_OPS)})"))
                    continue
                builder = ALL_OPS[name]()
                ok, why = builder.is_compatible()
                jit_ok, jit_why = builder.jit_available() if ok else (False, "")
                if not (ok and jit_ok):
                    rows.append((name, f"not built: {why or jit_why}"))
                    continue
            code = (
                "import sys\n"
                "from deepspeed_cpp.ops.op_builder import ALL_OPS, RegistryBuilder\n"
                "name = sys.argv[1]\n"
                "(RegistryBuilder if name == 'registry' else ALL_OPS[name])().load()\n"
            )
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-c", code, name], env=env, capture_output=True, text=True
            )
            seconds = time.perf_counter() - start
            if done.returncode != 0:
                last = (done.stderr.strip().splitlines() or ["?"])[-1]
                rows.append((name, f"build failed after {seconds:.1f} s: {last}"))
            else:
                rows.append((name, f"{seconds:.1f} s"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--load", action="store_true", help="load every available op and report on it"
    )
    parser.add_argument(
        "--timings",
        nargs="*",
        metavar="OP",
        help="time a JIT build of every op (or of the OPs named) from an empty cache (minutes)",
    )
    args = parser.parse_args(argv)

    from . import __version__

    rows = [
        ("deepspeed_cpp", __version__),
        ("python", platform.python_version()),
        ("torch", f"{torch.__version__} (CUDA build: {torch.version.cuda or 'no'})"),
        ("cuda available", str(torch.cuda.is_available())),
        ("nvcc", nvcc_version()),
        ("machine", f"{platform.machine()}, {os.cpu_count()} cores"),
        ("cpu features", " ".join(cpu_features()) or "none detected"),
        ("torch threads", str(torch.get_num_threads())),
        ("jit cache", str(jit_cache_root())),
    ]
    width = max(len(key) for key, _ in rows)
    print("deepspeed_cpp environment report")
    for key, value in rows:
        print(f"  {key:<{width}} : {value}")
    print("ops:")
    name_width = max(len(name) for name in ALL_OPS)
    for name, builder_class in ALL_OPS.items():
        builder = builder_class()
        line = f"  {name:<{name_width}} : {op_status(builder)}"
        # Loading is cheap once built; compiling is only done when asked for with --load.
        ready = builder.prebuilt_library() is not None or "already compiled" in line
        declined = cuda_build_declined(builder) if args.load and not ready else ""
        if declined:
            line += f"; {declined}"
        elif builder.is_compatible()[0] and (args.load or ready):
            try:
                builder.load()
                line += f"; loaded, {loaded_details(name)}".rstrip("; ,")
            except OpNotAvailableError as error:
                line += f"; load failed: {error}"
        print(line)
    if args.timings is not None:
        jobs = default_max_jobs()
        print(f"jit build time from an empty cache ({os.cpu_count()} cores, MAX_JOBS={jobs}):")
        for name, result in jit_build_timings(args.timings or list(ALL_OPS)):
            print(f"  {name:<{name_width}} : {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
