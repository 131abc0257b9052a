"""A pool of worker processes sharing one real gloo process group, reused across tests.

Starting processes and a process group costs seconds; tests send jobs (an importable function and
its arguments) to the same workers instead. Every rank runs the job; results come back per rank.
A job that raises on any rank raises here with that rank's traceback; a job that hangs (a
collective mismatch) fails after `timeout` seconds and the pool is torn down.

`shared_pool(world_size)` hands out one pool per world size for the whole test session (started
once, ~5 s of process start and torch import per pool on 2 cores, not once per module; conftest.py
prestarts the 2-rank pool when the session starts, beside the collection); a pool torn down by a
hung job is replaced by a fresh one at the next request. Jobs therefore must leave no state
behind that changes another module's results (a process group of their own, a global setting)
without undoing it.
"""

from __future__ import annotations

import atexit
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
        self._closed = False
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
        self.submit(function, *args)
        return self.collect(function, timeout)

    def submit(self, function, *args) -> None:
        """Hands function(*args) to every rank without waiting; collect() gets the results."""
        for jobs in self._jobs:
            jobs.put((function, args))

    def collect(self, function, timeout: float = 300.0) -> list:
        """The per-rank results of the job submitted last, in rank order."""
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

    @property
    def alive(self) -> bool:
        return not self._closed and all(process.is_alive() for process in self._processes)

    def close(self, force: bool = False) -> None:
        self._closed = True
        for jobs, process in zip(self._jobs, self._processes):
            if process.is_alive() and not force:
                jobs.put(None)
        for process in self._processes:
            process.join(timeout=0 if force else 30)
            if process.is_alive():
                process.kill()


def _ready() -> int:
    """The first job: the process group is up, and what nearly every job's first run would pay
    is paid here: deepspeed_cpp's import and torch._dynamo's, which the first call into a torch
    optimizer imports (as long as importing torch itself)."""
    import torch._dynamo  # noqa: F401

    import deepspeed_cpp  # noqa: F401

    return dist.get_rank()


def start_pool(world_size: int, attempts: int = 3) -> DistributedPool:
    """A pool whose process group is up (every rank answered a first job); a start that hangs is
    torn down and tried again."""
    for attempt in range(attempts):
        pool = DistributedPool(world_size)
        try:
            pool.run(_ready, timeout=120.0)
            return pool
        except TimeoutError:  # the pool is closed by run()
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


_SHARED: dict[int, DistributedPool] = {}
# Pools started ahead of their first use (prestart), their first job not yet collected.
_STARTING: dict[int, DistributedPool] = {}


def prestart(world_size: int) -> None:
    """Starts the session's pool of `world_size` ranks and its first job without waiting: while
    pytest collects the tests on one core, the workers import torch on the other."""
    if world_size not in _SHARED and world_size not in _STARTING:
        pool = _STARTING[world_size] = DistributedPool(world_size)
        pool.submit(_ready)


def shared_pool(world_size: int) -> DistributedPool:
    """The session's pool of `world_size` ranks, started on first use or after a hung job."""
    started = _STARTING.pop(world_size, None)
    if started is not None:
        try:
            started.collect(_ready, timeout=120.0)
            _SHARED[world_size] = started
        except TimeoutError:  # closed by collect(); started afresh below
            pass
    pool = _SHARED.get(world_size)
    if pool is None or not pool.alive:
        if pool is not None:
            pool.close(force=True)
        pool = _SHARED[world_size] = start_pool(world_size)
    return pool


class SessionPool:
    """The session's pool of `world_size` ranks as a fixture value: every run() goes to the live
    pool (a replacement after a hung job included), so module-scoped fixtures may hold one."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def run(self, function, *args, timeout: float = 300.0) -> list:
        return shared_pool(self.world_size).run(function, *args, timeout=timeout)


@atexit.register
def close_shared_pools() -> None:
    # Killed, not asked to leave: a rank that leaves its gloo group and exits takes ~4 s (measured
    # with idle pools of 2, 3 and 4 ranks), and at the session's end nothing is left to keep.
    for pool in [*_SHARED.values(), *_STARTING.values()]:
        pool.close(force=True)
    _SHARED.clear()
    _STARTING.clear()
