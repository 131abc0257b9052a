"""DeepSpeed's ``ThroughputTimer`` (``deepspeed.utils.timer``), which engines keep as
``engine.tput_timer``: training scripts read ``engine.tput_timer.avg_samples_per_sec()`` to
report their speed.

The engine starts it at each forward and stops it at each ``step()``, counting micro-steps and,
at accumulation boundaries, optimizer steps. The first ``start_step`` optimizer steps are not
timed (warm-up: allocation, first-touch, JIT); from then on the time between a forward and its
``step()`` adds up, and ``avg_samples_per_sec`` is ``batch_size`` samples per timed optimizer
step. Every counter and field has DeepSpeed's name and meaning, since scripts and DeepSpeed's
tests read them.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from .logging import logger

_TIME_EPSILON = 1e-6  # keeps the per-step speed finite for a step timed at zero seconds


class ThroughputConfig(NamedTuple):
    """DeepSpeed's ``timers.throughput`` section: what ``ThroughputTimer(config=...)`` reads."""

    enabled: bool = True
    synchronized: bool = True


# The engine's: timed on the host, no device synchronisation per forward and step (engine.py).
UNSYNCHRONIZED_THROUGHPUT = ThroughputConfig(enabled=True, synchronized=False)


def _synchronize() -> None:
    from ..accelerator import get_accelerator

    get_accelerator().synchronize()


class ThroughputTimer:
    """Samples per second over the optimizer steps after the first ``start_step``.

    ``config``: an object with ``enabled`` and ``synchronized`` (DeepSpeed's
    ``timers.throughput`` section); None is DeepSpeed's default, both on. ``batch_size``: the
    samples of one optimizer step (all ranks). ``steps_per_output``: log the speed at every that
    many optimizer steps (None: never; the engine reports its own speed line instead)."""

    def __init__(
        self,
        config=None,
        batch_size=None,
        start_step: int = 2,
        steps_per_output=None,
        monitor_memory: bool = False,
        logging_fn=None,
    ):
        self.enabled = True if config is None else bool(config.enabled)
        self.synchronized = True if config is None else bool(config.synchronized)
        self.batch_size = 1 if batch_size is None else batch_size
        self.start_step = start_step
        self.steps_per_output = steps_per_output
        self.monitor_memory = monitor_memory  # accepted for DeepSpeed's signature; not logged
        self.logging = logger.info if logging_fn is None else logging_fn
        self.start_time = 0
        self.end_time = 0
        self.started = False
        self.initialized = False
        self.epoch_count = 0
        self.micro_step_count = 0
        self.global_step_count = 0
        self.total_elapsed_time = 0
        self.step_elapsed_time = 0

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def start(self) -> None:
        if not self.enabled:
            return
        self.initialized = True
        self.started = True
        if self.global_step_count >= self.start_step:  # past the warm-up: timed
            if self.synchronized:
                _synchronize()
            self.start_time = time.time()

    def stop(self, global_step: bool = False, report_speed: bool = True) -> None:
        if not self.enabled or not self.started:
            return
        self.started = False
        self.micro_step_count += 1
        if global_step:
            self.global_step_count += 1
        if self.start_time <= 0:  # still warming up
            return
        if self.synchronized:
            _synchronize()
        self.end_time = time.time()
        duration = self.end_time - self.start_time
        self.total_elapsed_time += duration
        self.step_elapsed_time += duration
        if global_step:
            if report_speed and self._is_report_boundary():
                current = self.batch_size / (self.step_elapsed_time + _TIME_EPSILON)
                self.logging(
                    f"epoch={self.epoch_count}/micro_step={self.micro_step_count}/"
                    f"global_step={self.global_step_count}, "
                    f"RunningAvgSamplesPerSec={self.avg_samples_per_sec()}, "
                    f"CurrSamplesPerSec={current}"
                )
            self.step_elapsed_time = 0

    def _is_report_boundary(self) -> bool:
        return bool(self.steps_per_output) and self.global_step_count % self.steps_per_output == 0

    def avg_samples_per_sec(self) -> float:
        """Samples per second over the timed optimizer steps; -inf before the first step."""
        if self.global_step_count <= 0:
            return float("-inf")
        timed_steps = self.global_step_count - self.start_step
        if timed_steps <= 0 or self.total_elapsed_time <= 0:
            # DeepSpeed divides by zero here (ZeroDivisionError) while still warming up.
            return float("-inf")
        return self.batch_size / (self.total_elapsed_time / timed_steps)
