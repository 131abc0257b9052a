"""Read and write throughput of the aio handle against fio on the same file, block size and depth.

fio (the Debian package) measures what the disk can do with O_DIRECT on the same folder, file
size, block size and queue depth. It runs interleaved with ours, every run after the same idle
pause (fio's own start-up leaves the disk idle for a moment, which matters on disks that refill a
burst budget when idle), and the tables give the median of the repetitions.

The disk's speed drifts (a shared virtual disk here moves by +-30% within minutes), so every one
of our measurements is paired with a fio run taken right next to it (which one goes first
alternates), and the table gives the medians and the median of the per-pair ratios.

fio streams the file through queue_depth x block_size bytes of buffers that it reuses; where the
data lands can matter (a hypervisor copies it into guest memory). So each of our engines is
measured twice: streaming the file through one locked buffer of that same size (like for like
with fio, and how TensorSwapper moves data), and reading into or writing from one locked tensor
of the whole file size. Each engine is compared with fio on the same kernel interface, the
pread/pwrite thread pool with fio's io_uring. DeepSpeed's aio op is measured too when
``deepspeed`` is installed.

    python benchmarks/bench_aio.py [--folder DIR] [--size-mib 1024] [--block-kib 1024]
                                   [--depth 32] [--repeats 5] [--pause 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from deepspeed_cpp.ops.aio import AsyncIOHandle, usable_engines

# The fio engine each of ours is compared with (the thread pool has no fio twin: io_uring, the
# fastest interface, stands for the disk's limit).
REFERENCE = {"io_uring": "io_uring", "libaio": "libaio", "threads": "io_uring"}


def fio_gbps(path: str, direction: str, size: int, block: int, depth: int, engine: str) -> float:
    command = [
        "fio", "--name=bench", f"--filename={path}", f"--size={size}", f"--bs={block}",
        f"--iodepth={depth}", f"--rw={direction}", "--direct=1", f"--ioengine={engine}",
        "--numjobs=1", "--output-format=json",
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    job = json.loads(result.stdout[result.stdout.index("{") :])["jobs"][0][direction]
    return job["bw_bytes"] / 1e9


def timed_gbps(run, size: int) -> float:
    start = time.perf_counter()
    run()
    return size / (time.perf_counter() - start) / 1e9


def deepspeed_handle(block: int, depth: int):
    """DeepSpeed's aio handle when deepspeed is installed and its op builds here, else a reason."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder as DeepSpeedAsyncIOBuilder
    except ImportError:
        return None, "deepspeed is not installed (pip install deepspeed)"
    try:
        return DeepSpeedAsyncIOBuilder().load().aio_handle(block, depth, False, True, 1), ""
    except Exception as error:  # its JIT build can fail in many ways; report and carry on
        return None, f"DeepSpeed's aio op does not load: {error}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="where the test file goes (default: a temporary folder)")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pause", type=float, default=0.2, help="idle seconds before each run")
    args = parser.parse_args()

    size, block, depth = args.size_mib << 20, args.block_kib << 10, args.depth
    window = min(size, block * depth)  # fio's buffer footprint
    if size % window:
        parser.error(f"--size-mib must be a multiple of depth x block ({window >> 20} MiB)")
    folder = args.folder or tempfile.mkdtemp(prefix="bench_aio_")
    path = os.path.join(folder, "bench_aio.dat")
    have_fio = shutil.which("fio") is not None
    engines = usable_engines()
    handles = {engine: AsyncIOHandle(block, depth, engine=engine) for engine in engines}
    byte = torch.empty(0, dtype=torch.uint8)
    whole = handles[engines[0]].new_cpu_locked_tensor(size, byte).random_(0, 256)
    stream_buffer = handles[engines[0]].new_cpu_locked_tensor(window, byte).random_(0, 256)
    # A plain torch tensor one byte off a page boundary: every block goes through a bounce buffer.
    unaligned = torch.empty(size + 1, dtype=torch.uint8)[1:].random_(0, 256)
    ds_handle, ds_reason = deepspeed_handle(block, depth)
    if ds_handle is not None:
        ds_whole = ds_handle.new_cpu_locked_tensor(size, byte)

    def whole_tensor(handle, tensor, direction):
        call = handle.sync_pread if direction == "read" else handle.sync_pwrite
        return lambda: call(tensor, path)

    def streamed(handle, direction):
        # The file in window-sized requests, all from/into the same buffer, all submitted at
        # once: the handle keeps depth blocks in flight across them, as fio does.
        def run():
            for offset in range(0, size, window):
                if direction == "read":
                    handle.async_pread(stream_buffer, path, offset)
                else:  # like fio: overwrite the file in place, no truncation at offset 0
                    handle.async_pwrite(stream_buffer, path, offset, truncate=False)
            handle.wait()

        return run

    # Our rows: (label, the engine whose fio figures are its reference, direction -> run).
    rows = []
    for engine in engines:
        handle = handles[engine]
        rows.append((f"{engine}, {window >> 20} MiB buffer", engine,
                     lambda d, h=handle: streamed(h, d)))  # fmt: skip
        rows.append((f"{engine}, {args.size_mib} MiB tensor", engine,
                     lambda d, h=handle: whole_tensor(h, whole, d)))  # fmt: skip
    rows.append((f"{engines[0]}, {args.size_mib} MiB unaligned", engines[0],
                 lambda d: whole_tensor(handles[engines[0]], unaligned, d)))  # fmt: skip
    if ds_handle is not None:
        rows.append((f"deepspeed, {args.size_mib} MiB tensor", "libaio",
                     lambda d: whole_tensor(ds_handle, ds_whole, d)))  # fmt: skip

    def ours_gbps(make_run, direction):
        return timed_gbps(make_run(direction), size)

    def reference_gbps(engine, direction):
        return fio_gbps(path, direction, size, block, depth, REFERENCE[engine]) if have_fio else 0.0

    print(
        f"file {path}: {args.size_mib} MiB, block {args.block_kib} KiB, queue depth {depth}, "
        f"O_DIRECT; {args.repeats} repetitions after a warm-up, each measurement paired with "
        f"its fio run (order alternating), {args.pause} s idle before every run"
    )
    handles[engines[0]].sync_pwrite(whole, path)  # the file exists at full size from here on
    ours_values = {(d, label): [] for d in ("write", "read") for label, _, _ in rows}
    fio_values = {key: [] for key in ours_values}
    for repeat in range(args.repeats + 1):
        for number, (label, engine, make_run) in enumerate(rows):
            for direction in ("write", "read"):
                # The disk's speed drifts: each of our figures gets its own fio figure taken
                # right next to it, first or second in turn.
                ours_first = (repeat + number) % 2 == 0
                values = {}
                for side in ("ours", "fio") if ours_first else ("fio", "ours"):
                    time.sleep(args.pause)
                    if side == "ours":
                        values[side] = ours_gbps(make_run, direction)
                    else:
                        values[side] = reference_gbps(engine, direction)
                ours_value, fio_value = values["ours"], values["fio"]
                if repeat > 0:
                    ours_values[(direction, label)].append(ours_value)
                    fio_values[(direction, label)].append(fio_value)

    if not have_fio:
        print("fio is not installed (apt-get install fio): no reference")
    print(f"\n{'direction':<10}{'ours':<32}{'reference':<14}{'ref GB/s':>9}{'ours GB/s':>10}"
          f"{'ours/ref':>9}  {'range of the pairs':<18}")  # fmt: skip
    for direction in ("write", "read"):
        for label, engine, _ in rows:
            ours_list, fio_list = ours_values[(direction, label)], fio_values[(direction, label)]
            ours_value = statistics.median(ours_list)
            if not have_fio:
                print(f"{direction:<10}{label:<32}{'n/a':<14}{'':>9}{ours_value:>10.2f}")
                continue
            ratios = [o / f for o, f in zip(ours_list, fio_list)]
            spread = f"{min(ratios):.0%} to {max(ratios):.0%}"
            print(f"{direction:<10}{label:<32}{'fio ' + REFERENCE[engine]:<14}"
                  f"{statistics.median(fio_list):>9.2f}{ours_value:>10.2f}"
                  f"{statistics.median(ratios):>9.1%}  {spread}")  # fmt: skip
    if ds_handle is None:
        print(f"DeepSpeed's aio: skipped, {ds_reason}")
    os.remove(path)
    if not args.folder:
        os.rmdir(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
