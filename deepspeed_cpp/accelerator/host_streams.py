"""Streams and events for the CPU, where every op finishes before the call that queued it returns.

Code written for GPUs overlaps work by queueing it on side streams and ordering streams with
events. On the CPU there is nothing to overlap or order, so these classes accept the same calls
and do nothing, except that an event with ``enable_timing=True`` remembers the host clock at
``record()``: since CPU work is synchronous, the time between two records is the time the work
between them took, which is exactly what a CUDA event pair measures.
"""

from __future__ import annotations

import contextlib
import time


class HostEvent:
    """An event on the host: ``record()`` notes the time; waiting on it returns at once."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess=False):
        self.enable_timing = enable_timing
        self._recorded_at: float | None = None

    def record(self, stream: HostStream | None = None) -> None:
        """Mark this point of the (already finished) host work."""
        self._recorded_at = time.perf_counter()

    def query(self) -> bool:
        """Always true: host work is done when the call that queued it returns."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for on the host."""

    def wait(self, stream: HostStream | None = None) -> None:
        """Nothing to wait for on the host."""

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds between this event's ``record()`` and ``end_event``'s."""
        for name, event in (("self", self), ("end_event", end_event)):
            if not event.enable_timing:
                raise RuntimeError(
                    f"elapsed_time: {name} was created with enable_timing=False; "
                    "create both events with Event(enable_timing=True)"
                )
            if event._recorded_at is None:
                raise RuntimeError(f"elapsed_time: {name} was never recorded; call record() first")
        return (end_event._recorded_at - self._recorded_at) * 1000.0


class HostStream:
    """A stream on the host: work runs in call order, so every ordering call is a no-op."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = device
        self.priority = priority

    def synchronize(self) -> None:
        """Nothing queued to wait for."""

    def query(self) -> bool:
        """Always true: nothing is ever pending."""
        return True

    def wait_stream(self, stream: HostStream) -> None:
        """Already ordered: host work runs in call order."""

    def wait_event(self, event: HostEvent) -> None:
        """Already ordered: host work runs in call order."""

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        """Record ``event`` (a new one when None) at this point and return it."""
        event = HostEvent() if event is None else event
        event.record(self)
        return event

    def __enter__(self) -> HostStream:
        return self

    def __exit__(self, *exc_info) -> None:
        return None


# The one stream the host has: current and default are the same object, as on a fresh GPU.
HOST_DEFAULT_STREAM = HostStream()


def host_stream_context(stream: HostStream | None):
    """``with accelerator.stream(s):`` on the host: nothing changes, work stays in order."""
    return contextlib.nullcontext(stream)
