"""Collective failures that name the collective and the ranks that did not answer.

A rank that stops responding (SIGSTOP, a hung data loader, a debugger) makes its peers' next
collective fail after the process group's timeout with the backend's own text — gloo says
"Timed out waiting 8000ms for recv operation to complete" — which names neither the collective
nor the rank. ``named_collective`` wraps the engine's waits: on such a failure it asks the
rendezvous store which ranks reached the same failure within a short grace period and raises
``CollectiveTimeoutError`` naming the collective, this rank and the ranks that did not report.

Nothing runs on the success path but a ``try`` (free in CPython 3.11), so a step pays nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

# Texts of the backends' failures that mean "a peer did not take part" rather than a usage error
# (a shape mismatch must keep its own message). gloo: "Timed out waiting ...", "Connection
# closed by peer", "Connection reset by peer"; nccl: "Watchdog caught collective operation
# timeout".
_PEER_FAILURE_MARKERS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
)
_REPORT_KEY = "deepspeed_cpp/collective_failure/{}"
_configured_timeout: timedelta | None = None


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete because one or more ranks did not answer in time."""


def set_configured_timeout(timeout: timedelta | None) -> None:
    global _configured_timeout
    _configured_timeout = timeout


def configured_timeout() -> timedelta | None:
    return _configured_timeout


def new_group(ranks, **kwargs) -> dist.ProcessGroup:
    """``dist.new_group`` bounded by the configured timeout. torch gives a new group its
    backend's default timeout (30 minutes for gloo), not the default group's, so without this a
    silent rank would hold a subgroup's collectives for half an hour whatever
    ``init_distributed(timeout=...)`` said."""
    if _configured_timeout is not None:
        kwargs.setdefault("timeout", _configured_timeout)
    group = dist.new_group(ranks, **kwargs)
    # torch no longer waits after making a group (TORCH_DIST_INIT_BARRIER unset): on gloo a
    # member that returns from its half of the connection set-up and destroys the group at once
    # (an engine built and destroyed in a few milliseconds) closes the sockets its peer is still
    # connecting ("Gloo connectFullMesh failed ... Connection closed by peer", seen once in CI).
    # A barrier over the new group returns only once every member is connected.
    if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
        if dist.get_backend(group) == "gloo":
            with named_collective("barrier after creating a process group"):
                dist.barrier(group=group)
    return group


def _is_peer_failure(error: BaseException) -> bool:
    text = str(error).lower()
    return any(marker in text for marker in _PEER_FAILURE_MARKERS)


def _grace_seconds() -> float:
    # Peers blocked in the same collective time out within about the same moment; give them a
    # little time to report, bounded so that the error itself arrives soon after the timeout.
    timeout = _configured_timeout.total_seconds() if _configured_timeout else 30.0
    return max(0.5, min(3.0, timeout / 4))


def _ranks_that_reported(what: str) -> tuple[list[int], str]:
    """Publishes this rank's failure in the store and collects who else published theirs."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.distributed_c10d._get_default_store()
        grace = _grace_seconds()
        store.set_timeout(timedelta(seconds=grace))
        store.set(_REPORT_KEY.format(rank), what)
        deadline = time.monotonic() + grace
        reported = {rank}
        while time.monotonic() < deadline and len(reported) < world:
            for other in range(world):
                if other not in reported and store.check([_REPORT_KEY.format(other)]):
                    reported.add(other)
            time.sleep(0.05)
        return sorted(reported), ""
    except Exception as error:  # the store lives in rank 0's process: it may be the silent one
        return [rank], f"; the rendezvous store did not answer either ({type(error).__name__})"


def describe_failure(what: str, error: BaseException) -> str:
    rank, world = dist.get_rank(), dist.get_world_size()
    reported, store_note = _ranks_that_reported(what)
    silent = [r for r in range(world) if r not in reported]
    timeout = _configured_timeout
    limit = f" within the timeout of {timeout.total_seconds():g} s" if timeout else ""
    if silent:
        who = f"rank(s) {', '.join(map(str, silent))} did not answer{limit}"
        who += " (stopped, hung, or waiting in another collective)"
    else:
        who = f"every rank reports a failure in this collective{limit}"
    backend = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"{what} failed on rank {rank} of {world}: {who}{store_note}. "
        f"Backend error: {backend}. The timeout is init_distributed(timeout=...) or the "
        f"DEEPSPEED_TIMEOUT environment variable (minutes)."
    )


@contextmanager
def named_collective(what: str | Callable[[], str]):
    """Runs the body; a peer failure inside it becomes a ``CollectiveTimeoutError``.

    ``what`` names the collective ("all_gather of parameter bucket 3 of 8"); a callable is only
    called on failure, so that call sites in loops format nothing on the success path.
    """
    try:
        yield
    except CollectiveTimeoutError:
        raise  # already named by an inner wrapper
    except RuntimeError as error:
        if not dist.is_initialized() or not _is_peer_failure(error):
            raise
        label = what() if callable(what) else what
        raise CollectiveTimeoutError(describe_failure(label, error)) from error
