"""What the engine reports about its steps: monitor events and wall-clock timers, at DeepSpeed's
cadence. The engine calls ``begin``/``end`` around its phases and ``after_backward``/
``after_step``; everything else (names, cadence, ranks) is decided here.

DeepSpeed's cadence, kept: at every accumulation boundary rank 0 writes ``Train/Samples/
train_loss`` (the mean of the micro-steps' losses, rank 0's own, at the samples seen before the
step), then after the step ``Train/Samples/lr`` (the first param group's, after the schedule
stepped) and, with fp16, ``Train/Samples/loss_scale``, at the samples seen after it. With
``wall_clock_breakdown`` the micro timers are logged at every ``step()`` call and the global
ones every ``steps_per_print`` steps, with the monitors also getting ``Train/Samples/
elapsed_time_ms_*`` at every boundary; ZeRO-3's gather, reduce-scatter and optimizer-step timers
are logged at every boundary. With ``flops_profiler`` rank 0 profiles the forward
passes of step ``profile_step`` (counted from 0, before it is taken) and prints the profile when
that step is taken, as DeepSpeed does.
"""

from __future__ import annotations

import time

import torch

from ..accelerator import get_accelerator
from ..monitor import MonitorMaster
from ..utils.logging import logger
from ..utils.timer import (
    GLOBAL_TIMERS,
    MICRO_TIMERS,
    ZERO3_TIMERS,
    NoopTimer,
    SynchronizedWallClockTimer,
)

# Global timer -> the monitor event DeepSpeed writes for it.
_ELAPSED_EVENTS = {
    "fwd": "Train/Samples/elapsed_time_ms_forward",
    "bwd": "Train/Samples/elapsed_time_ms_backward",
    "bwd_inner": "Train/Samples/elapsed_time_ms_backward_inner",
    "bwd_allreduce": "Train/Samples/elapsed_time_ms_backward_allreduce",
    "step": "Train/Samples/elapsed_time_ms_step",
}


class TrainingReport:
    def __init__(self, config, rank: int) -> None:
        self.monitor = MonitorMaster(config, rank)
        self.wall_clock_breakdown = bool(config.wall_clock_breakdown)
        self.memory_breakdown = bool(config.memory_breakdown)
        self.timers = SynchronizedWallClockTimer() if self.wall_clock_breakdown else NoopTimer()
        self.steps_per_print = config.steps_per_print
        self._writes = bool(self.monitor.monitors)  # rank 0 with a back-end enabled
        self._losses: torch.Tensor | None = None
        self.flops = config.flops_profiler
        self.flops_profiler = None  # built on rank 0 at its first forward
        # The profiled step's fwd/bwd/step seconds (summed over its micro-steps), which
        # DeepSpeed's engine-driven profile prints beside the counts; None outside that step.
        self._phase_seconds: dict[str, float] | None = None
        self._phase_starts: dict[str, float] = {}
        self._rank = rank
        self._last_log = (time.perf_counter(), 0)  # for the samples/sec of the progress line

    # --- timers: "fwd", "bwd", "bwd_inner", "bwd_allreduce", "step" (micro and global) ----------
    def begin(self, name: str) -> None:
        if self._phase_seconds is not None:
            get_accelerator().synchronize()
            self._phase_starts[name] = time.perf_counter()
        if self.wall_clock_breakdown:
            for timer in (self.timers(f"{name}_microstep"), self.timers(name)):
                if timer.started_:  # a phase that raised part-way never ended
                    timer.reset()
                timer.start()

    def end(self, name: str) -> None:
        if self.wall_clock_breakdown:
            self.timers(f"{name}_microstep").stop()
            self.timers(name).stop()
        if self._phase_seconds is not None and name in self._phase_starts:
            get_accelerator().synchronize()
            elapsed = time.perf_counter() - self._phase_starts.pop(name)
            self._phase_seconds[name] = self._phase_seconds.get(name, 0.0) + elapsed

    def before_forward(self, engine) -> None:
        profiles = self._profiles(engine)
        if not profiles:
            self._phase_seconds = None  # a profiled step that raised before it was printed
        elif self._phase_seconds is None:
            self._phase_seconds = {}
        self.begin("fwd")
        if profiles:
            if self.flops_profiler is None:
                from ..profiling.flops_profiler import FlopsProfiler

                self.flops_profiler = FlopsProfiler(
                    engine.module, engine, self.flops.recompute_fwd_factor
                )
            self.flops_profiler.start_profile()  # each micro-step anew: the last one is shown

    def after_forward(self, engine) -> None:
        if self.flops_profiler is not None and self.flops_profiler.started:
            self.flops_profiler.stop_profile()
        self.end("fwd")

    def _profiles(self, engine) -> bool:
        return (
            self.flops.enabled
            and self._rank == 0
            and engine.global_steps == self.flops.profile_step
        )

    def before_step(self, engine) -> bool:
        """Whether this step() is the profiled one (asked before global_steps moves on)."""
        return self._profiles(engine) and self.flops_profiler is not None

    def print_flops_profile(self, engine) -> None:
        # DeepSpeed heads the profile with the step count after the profiled step was taken
        # (profile_step + 1), which is ``global_steps`` here.
        self.flops_profiler.print_model_profile(
            profile_step=engine.global_steps,
            module_depth=self.flops.module_depth,
            top_modules=self.flops.top_modules,
            detailed=self.flops.detailed,
            output_file=self.flops.output_file,
            phase_seconds=self._phase_seconds,
        )
        self.flops_profiler.end_profile()
        self._phase_seconds = None

    # --- events -----------------------------------------------------------------------------
    def after_backward(self, loss: torch.Tensor, divisor: int, boundary: bool, samples: int):
        """Adds this micro-step's loss (divided as backward divided it); writes the sum at the
        boundary."""
        if not self._writes:
            return
        mean = loss.detach().float().mean()
        if divisor > 1:
            mean = mean / divisor
        self._losses = mean if self._losses is None else self._losses + mean
        if boundary:
            self.monitor.write_events([("Train/Samples/train_loss", self._losses.item(), samples)])
            self._losses = None

    def after_step(self, engine, boundary: bool, profiled: bool = False) -> None:
        if boundary:
            self._log_progress(engine)
        if profiled and boundary:
            self.print_flops_profile(engine)
        if boundary and self._writes:
            lrs = engine.get_lr()
            events = [("Train/Samples/lr", lrs[0], engine.global_samples)] if lrs else []
            if engine.fp16_enabled():
                events.append(
                    ("Train/Samples/loss_scale", engine.get_loss_scale(), engine.global_samples)
                )
            self.monitor.write_events(events)
        if not self.wall_clock_breakdown:
            return
        self.timers.log(MICRO_TIMERS, memory_breakdown=self.memory_breakdown)
        if not boundary:
            return
        # ZeRO-3's collectives and step, summed over this step's micro-steps (those that ran).
        zero3 = [name for name in ZERO3_TIMERS if name in self.timers.get_timers()]
        if zero3:
            self.timers.log(zero3)
        if self._writes:
            self.monitor.write_events(
                (event, self.timers(name).elapsed(reset=False) * 1000.0, engine.global_samples)
                for name, event in _ELAPSED_EVENTS.items()
            )
        every = self.steps_per_print
        if every and engine.global_steps % every == 0:
            self.timers.log(GLOBAL_TIMERS)

    def _log_progress(self, engine) -> None:
        """Rank 0's progress line every ``steps_per_print`` steps (DeepSpeed's cadence)."""
        every = self.steps_per_print
        if not every or engine.global_steps % every != 0 or engine.global_rank != 0:
            return
        now = time.perf_counter()
        last_time, last_samples = self._last_log
        samples_per_second = (engine.global_samples - last_samples) / max(now - last_time, 1e-9)
        self._last_log = (now, engine.global_samples)
        scale = engine.loss_scaler.loss_scale if engine.loss_scaler is not None else 1.0
        logger.info(
            "deepspeed_cpp: step=%d skipped=%d lr=%s loss_scale=%s samples/sec=%.2f",
            engine.global_steps,
            engine.skipped_steps,
            [round(lr, 10) for lr in engine.get_lr()],
            scale,
            samples_per_second,
        )

    def close(self) -> None:
        self.monitor.close()
