"""Runs a benchmark function on N local processes that share one gloo process group."""

from __future__ import annotations

import os
import socket
import traceback
import warnings

import torch.distributed as dist
import torch.multiprocessing as mp


def run_on_ranks(procs: int, worker, *args) -> list:
    """Spawns ``procs`` processes, joins them in a gloo group and calls ``worker(rank, *args)``
    in each (``worker`` must be a module-level function); returns the workers' return values in
    rank order, or raises with the traceback of a rank that failed."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [
        context.Process(target=_run_rank, args=(rank, procs, port, results, worker, args))
        for rank in range(procs)
    ]
    for process in processes:
        process.start()
    reports = dict(results.get() for _ in processes)
    for process in processes:
        process.join()
    for rank, (ok, value) in sorted(reports.items()):
        if not ok:
            raise RuntimeError(f"rank {rank} failed:\n{value}")
    return [reports[rank][1] for rank in range(procs)]


def _run_rank(rank: int, procs: int, port: int, results, worker, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(procs), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    try:
        results.put((rank, (True, worker(rank, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, (False, traceback.format_exc())))
    finally:
        dist.destroy_process_group()
