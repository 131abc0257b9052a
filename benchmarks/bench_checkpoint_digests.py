"""What checkpoint integrity costs: writing a file with its SHA-256 computed from the stream, and
reading it back with the digest checked first, beside the same write and read without digests.

    python benchmarks/bench_checkpoint_digests.py [--mb 256] [--repeat 3] [--dir /tmp]

Prints the best of ``--repeat`` runs (seconds and GB/s) for each, and the ratio to the plain
operation. The reads find the file in the page cache (it was just written), so they show the
hashing's CPU cost, not the disk's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from pathlib import Path

import torch

from deepspeed_cpp.runtime.checkpoint.atomic_files import save_torch_atomically, write_atomically
from deepspeed_cpp.runtime.checkpoint.shard_reader import load_mapped


def best_of(repeat: int, function) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    payload = {"master": torch.randn(args.mb * (1 << 20) // 4)}
    path = Path(args.dir) / f"bench_digests_{os.getpid()}.pt"
    try:
        plain_write = best_of(
            args.repeat, lambda: write_atomically(path, lambda h: torch.save(payload, h))
        )
        digest_write = best_of(args.repeat, lambda: save_torch_atomically(payload, path))
        data = path.read_bytes()
        hash_only = best_of(args.repeat, lambda: hashlib.sha256(data).hexdigest())
        expected = hashlib.sha256(data).hexdigest()
        data = b""
        plain_read = best_of(args.repeat, lambda: load_mapped(path, None)["master"].sum())
        digest_read = best_of(args.repeat, lambda: load_mapped(path, expected)["master"].sum())
    finally:
        path.unlink(missing_ok=True)
    size = args.mb * (1 << 20)
    print(f"{args.mb} MiB file, best of {args.repeat}; {torch.get_num_threads()} torch threads")
    print(f"{'operation':44s} {'seconds':>8s} {'GB/s':>7s} {'ratio':>6s}")
    rows = [
        ("write (torch.save, fsync, rename)", plain_write, plain_write),
        ("write + SHA-256 from the stream", digest_write, plain_write),
        ("SHA-256 of the bytes in memory (hashlib)", hash_only, hash_only),
        ("read (mmap torch.load, sum)", plain_read, plain_read),
        ("read + SHA-256 check first (one pass)", digest_read, plain_read),
    ]
    for name, seconds, reference in rows:
        print(f"{name:44s} {seconds:8.3f} {size / seconds / 1e9:7.2f} {seconds / reference:6.2f}")


if __name__ == "__main__":
    main()
