"""Counts the C++ gradient reducer's collectives for the comms logger, at the Python boundary.

The reducer (csrc/zero/grad_reducer.cpp) launches one collective per bucket straight on the c10d
ProcessGroup, out of Python's sight, so it is wrapped where Python drives it: the bucket plan
says when a bucket is complete (its last parameter's gradient arrived: the reducer launches
complete buckets in index order) and ``harvested()`` when its reduction is done, so the latency
recorded is launch to the first moment Python saw it done (at a later hand-over or at
``finish()``): an upper bound, and exact for the buckets ``finish()`` waits for. Each bucket is
one ``reduce_scatter_tensor`` or ``all_reduce`` (as the reducer's ``collective()`` says) of its
fp32 buffer.

Chosen over a process-group-level hook because gloo has none (only NCCL has completion hooks)
and over a change in C++ because the plan already tells Python everything but the exact end.
"""

from __future__ import annotations

import time

import torch.distributed as dist

from .collective_tap import record_name
from .comms_logger import comms_logger

_FP32_BYTES = 4


class LoggedGradientReducer:
    """Delegates to the reducer; records one collective per bucket and micro-step."""

    def __init__(self, reducer, plan, group) -> None:
        self._reducer = reducer
        self._param_bucket = list(plan.param_bucket)
        self._members = [0] * len(plan.bucket_sizes)
        for bucket in self._param_bucket:
            self._members[bucket] += 1
        self._sizes = [int(size) * _FP32_BYTES for size in plan.bucket_sizes]
        self._world = dist.get_world_size(group)
        method = reducer.collective()
        self._op = "reduce_scatter_tensor" if method == "reduce_scatter" else "all_reduce"
        self._reset()

    def _reset(self) -> None:
        self._arrived = [0] * len(self._members)
        self._launched: list[float] = []  # launch time of buckets 0 .. len-1
        self._recorded = 0

    def _launch_complete(self, now: float) -> None:
        while len(self._launched) < len(self._members):
            bucket = len(self._launched)
            if self._arrived[bucket] < self._members[bucket]:
                return
            self._launched.append(now)

    def _record_done(self, upto: int, now: float) -> None:
        if not comms_logger.wants(self._op):
            self._recorded = max(self._recorded, upto)
            return
        name = record_name(self._op)
        for bucket in range(self._recorded, upto):
            latency = (now - self._launched[bucket]) * 1e3
            comms_logger.append(self._op, name, latency, self._sizes[bucket], self._world)
        self._recorded = max(self._recorded, upto)

    def add_grad(self, param: int, grad) -> None:
        self._reducer.add_grad(param, grad)
        now = time.perf_counter()
        self._arrived[self._param_bucket[param]] += 1
        self._launch_complete(now)
        self._record_done(min(self._reducer.harvested(), len(self._launched)), now)

    def finish(self):
        start = time.perf_counter()
        # finish() fills the buckets that missed gradients and launches them first.
        self._launched += [start] * (len(self._members) - len(self._launched))
        result = self._reducer.finish()
        self._record_done(len(self._members), time.perf_counter())
        self._reset()
        return result

    def __getattr__(self, name):
        return getattr(self._reducer, name)


def logged_if_enabled(reducer, plan, group):
    """The reducer itself while the comms logger is off (no cost), else the counting wrapper."""
    if not comms_logger.enabled:
        return reducer
    return LoggedGradientReducer(reducer, plan, group)
