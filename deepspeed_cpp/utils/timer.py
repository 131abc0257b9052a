"""Wall-clock timers under DeepSpeed's names (``deepspeed.utils.timer``).

The engine keeps a ``SynchronizedWallClockTimer`` when ``wall_clock_breakdown`` is on and a
``NoopTimer`` otherwise, so that timing costs nothing unless asked for. "Synchronized": the
device is synchronized at start and stop, so a timer measures the work, not its launch.
"""

from __future__ import annotations

import os
import time

from .logging import logger
from .throughput_timer import ThroughputTimer  # noqa: F401 - DeepSpeed's name in this module

# DeepSpeed's engine timer names: a micro timer covers one micro-step and is logged at every
# step() call; a global timer sums the micro-steps since it was last logged (every
# steps_per_print optimizer steps).
FORWARD_MICRO_TIMER = "fwd_microstep"
FORWARD_GLOBAL_TIMER = "fwd"
BACKWARD_MICRO_TIMER = "bwd_microstep"
BACKWARD_GLOBAL_TIMER = "bwd"
BACKWARD_INNER_MICRO_TIMER = "bwd_inner_microstep"
BACKWARD_INNER_GLOBAL_TIMER = "bwd_inner"
BACKWARD_REDUCE_MICRO_TIMER = "bwd_allreduce_microstep"
BACKWARD_REDUCE_GLOBAL_TIMER = "bwd_allreduce"
STEP_MICRO_TIMER = "step_microstep"
STEP_GLOBAL_TIMER = "step"

MICRO_TIMERS = (
    FORWARD_MICRO_TIMER,
    BACKWARD_MICRO_TIMER,
    BACKWARD_INNER_MICRO_TIMER,
    BACKWARD_REDUCE_MICRO_TIMER,
    STEP_MICRO_TIMER,
)
GLOBAL_TIMERS = (
    FORWARD_GLOBAL_TIMER,
    BACKWARD_GLOBAL_TIMER,
    BACKWARD_INNER_GLOBAL_TIMER,
    BACKWARD_REDUCE_GLOBAL_TIMER,
    STEP_GLOBAL_TIMER,
)

# ZeRO-3's collectives and step. DeepSpeed's names where it has them: its parameter coordinator's
# fetch events (``forward_fetch_submit`` ... ``backward_all_gather``, which DeepSpeed only records
# with a profiler switch compiled off) and its stage-3 ``optimizer_step``. DeepSpeed times no
# stage-3 gradient reduce-scatter of its own; ours are named like the fetch pairs: the launches
# during backward (``reduce_scatter_submit``, the copy into the bucket included) and the wait for
# the last ones when backward ends (``reduce_scatter_wait``). Each sums one optimizer step's
# micro-steps and is logged, in one line, at every accumulation boundary.
FORWARD_FETCH_SUBMIT_TIMER = "forward_fetch_submit"
FORWARD_FETCH_WAIT_TIMER = "forward_fetch_wait"
FORWARD_ALL_GATHER_TIMER = "forward_all_gather"
BACKWARD_FETCH_SUBMIT_TIMER = "backward_fetch_submit"
BACKWARD_FETCH_WAIT_TIMER = "backward_fetch_wait"
BACKWARD_ALL_GATHER_TIMER = "backward_all_gather"
REDUCE_SCATTER_SUBMIT_TIMER = "reduce_scatter_submit"
REDUCE_SCATTER_WAIT_TIMER = "reduce_scatter_wait"
OPTIMIZER_STEP_TIMER = "optimizer_step"

ZERO3_TIMERS = (
    FORWARD_FETCH_SUBMIT_TIMER,
    FORWARD_ALL_GATHER_TIMER,
    FORWARD_FETCH_WAIT_TIMER,
    BACKWARD_FETCH_SUBMIT_TIMER,
    BACKWARD_ALL_GATHER_TIMER,
    BACKWARD_FETCH_WAIT_TIMER,
    REDUCE_SCATTER_SUBMIT_TIMER,
    REDUCE_SCATTER_WAIT_TIMER,
    OPTIMIZER_STEP_TIMER,
)


class timed:  # noqa: N801 - used as a context manager, like contextlib's
    """``with timed(timers, name):`` times the block under ``name``; does nothing when
    ``timers`` is None (``wall_clock_breakdown`` off) or that timer already runs (a block
    re-entered from inside itself is counted once, by the outer one)."""

    __slots__ = ("_timer",)

    def __init__(self, timers, name: str) -> None:
        timer = None if timers is None else timers(name)
        self._timer = None if timer is None or getattr(timer, "started_", True) else timer

    def __enter__(self) -> None:
        if self._timer is not None:
            self._timer.start()

    def __exit__(self, *exc_info) -> None:
        if self._timer is not None:
            self._timer.stop()


def _synchronize() -> None:
    from ..accelerator import get_accelerator

    get_accelerator().synchronize()


class _Timer:
    def __init__(self, name: str, synchronize) -> None:
        self.name_ = name
        self._synchronize = synchronize
        self.started_ = False
        self._start = 0.0
        self._elapsed = 0.0
        self.count = 0

    def start(self) -> None:
        assert not self.started_, f"timer {self.name_} has already been started"
        self._synchronize()
        self._start = time.perf_counter()
        self.started_ = True

    def stop(self, reset: bool = False, record: bool = True) -> None:
        assert self.started_, f"timer {self.name_} is not started"
        self._synchronize()
        if reset:
            self._elapsed = 0.0
        if record:
            self._elapsed += time.perf_counter() - self._start
            self.count += 1
        self.started_ = False

    def reset(self) -> None:
        self._elapsed = 0.0
        self.count = 0
        self.started_ = False

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated (a running timer is stopped and restarted around the read)."""
        running = self.started_
        if running:
            self.stop()
        elapsed = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start()
        return elapsed


class SynchronizedWallClockTimer:
    """``timers(name).start()/stop()/elapsed()``; ``log(names)`` prints DeepSpeed's line."""

    def __init__(self, synchronize=_synchronize) -> None:
        self.timers: dict[str, _Timer] = {}
        self._synchronize = synchronize

    def __call__(self, name: str) -> _Timer:
        if name not in self.timers:
            self.timers[name] = _Timer(name, self._synchronize)
        return self.timers[name]

    def get_timers(self) -> dict[str, _Timer]:
        return self.timers

    @staticmethod
    def memory_usage() -> str:
        """Host RSS and the device's allocator figures, as ``| name: x.xx GB`` parts."""
        from ..accelerator import get_accelerator

        gib = 1024**3
        accelerator = get_accelerator()
        parts = [f" | host_rss: {host_rss_bytes() / gib:.2f} GB"]
        if accelerator.device_name() != "cpu":
            parts += [
                f" | mem_allocated: {accelerator.memory_allocated() / gib:.2f} GB",
                f" | max_mem_allocated: {accelerator.max_memory_allocated() / gib:.2f} GB",
                f" | cache_allocated: {accelerator.memory_reserved() / gib:.2f} GB",
                f" | max_cache_allocated: {accelerator.max_memory_reserved() / gib:.2f} GB",
            ]
        return "".join(parts)

    def log(
        self, names, normalizer: float = 1.0, reset: bool = True, memory_breakdown=False, ranks=None
    ) -> str:
        """Logs ``time (ms) | name: x.xx | ...`` for the named timers that exist (on rank 0, or
        on ``ranks``) and returns the line."""
        assert normalizer > 0.0
        line = "time (ms)"
        for name in names:
            if name in self.timers:
                elapsed = self.timers[name].elapsed(reset=reset) * 1000.0 / normalizer
                line += f" | {name}: {elapsed:.2f}"
        if memory_breakdown:
            line += self.memory_usage()
        if _rank() in (ranks or [0]):
            logger.info(line)
        return line


class NoopTimer:
    """The timers when ``wall_clock_breakdown`` is off: every call does nothing."""

    class Timer:
        def start(self) -> None: ...

        def stop(self, reset: bool = False, record: bool = True) -> None: ...

        def reset(self) -> None: ...

        def elapsed(self, reset: bool = True) -> float:
            return 0.0

    _timer = Timer()

    def __call__(self, name: str) -> NoopTimer.Timer:
        return self._timer

    def get_timers(self) -> dict:
        return {}

    def log(
        self, names, normalizer: float = 1.0, reset: bool = True, memory_breakdown=False, ranks=None
    ) -> str:
        return ""


def host_rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unreadable)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
