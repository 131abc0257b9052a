"""A pool of worker processes sharing one real gloo process group, reused across tests.

Starting processes and a process group costs seconds; tests send jobs (an importable function and
its arguments) to the same workers instead. Every rank runs the job; results come back per rank.
A job that raises on any rank raises here with that rank's traceback; a job that hangs (a
collective mismatch) fails after `timeout` seconds and the pool is torn down.
"""

from __future__ import annotations

import os
import queue
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, port: int, jobs, results) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    while True:
        job = jobs.get()
        if job is None:
            break
        function, args = job
        try:
            results.put((rank, True, function(*args)))
        except BaseException:  # noqa: BLE001 - reported to the test process
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class DistributedPool:
    def __init__(self, world_size: int):
        context = mp.get_context("spawn")
        self.world_size = world_size
        self._jobs = [context.Queue() for _ in range(world_size)]
        self._results = context.Queue()
        # The rendezvous store lives here, on a port the kernel picked and that stays bound: no
        # window in which another test run could take a port chosen in advance.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = self._store.port
        self._processes = [
            context.Process(
                target=_worker,
                args=(r, world_size, port, self._jobs[r], self._results),
                daemon=True,
            )  # fmt: skip
            for r in range(world_size)
        ]
        for process in self._processes:
            process.start()

    def run(self, function, *args, timeout: float = 300.0) -> list:
        """Runs function(*args) on every rank; returns the per-rank results in rank order."""
        for jobs in self._jobs:
            jobs.put((function, args))
        outcomes = {}
        try:
            for _ in range(self.world_size):
                rank, ok, value = self._results.get(timeout=timeout)
                outcomes[rank] = (ok, value)
        except queue.Empty:
            self.close(force=True)
            raise TimeoutError(
                f"{function.__name__} did not finish on every rank in {timeout}s"
            ) from None
        failures = [f"rank {r}:\n{v}" for r, (ok, v) in sorted(outcomes.items()) if not ok]
        if failures:
            raise RuntimeError(f"{function.__name__} failed:\n" + "\n".join(failures))
        return [outcomes[r][1] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        for jobs, process in zip(self._jobs, self._processes):
            if process.is_alive() and not force:
                jobs.put(None)
        for process in self._processes:
            process.join(timeout=0 if force else 30)
            if process.is_alive():
                process.kill()
