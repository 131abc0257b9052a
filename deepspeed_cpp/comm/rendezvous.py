"""torch's rendezvous inside ``init_process_group``, with failures that name the rendezvous.

``dist.init_process_group`` meets the other ranks in two stages, both torch's own: it connects
to the rendezvous store (``MASTER_ADDR:MASTER_PORT``; rank 0 hosts it, or torchrun's agent when
launched by torchrun), then the backend connects every pair of ranks through that store. A rank
that never arrives, or a wrong address or port, surfaces as the store's or the backend's
generic text ("The client socket has timed out ...", "Timed out waiting ... for key ...") or,
with torch's 30-minute default, as a hang. Here the two stages run one after the other, the
same torch calls, so that a failure says which stage, the store's address, the world size and,
once the store answers, which ranks arrived and which did not.

Each rank writes one key to the store before the backend connects; a rank whose backend
connection timed out reads those keys to name the ranks that never came.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

_ARRIVED_KEY = "deepspeed_cpp/rendezvous/arrived/{}"
# Reading the arrival keys after a failure must not itself wait out a long timeout.
_ARRIVAL_CHECK_TIMEOUT = timedelta(seconds=5)


class RendezvousError(RuntimeError):
    """The ranks did not all meet in ``init_distributed`` within the timeout."""


def _store_address(init_method: str) -> str:
    if init_method.startswith("env://"):
        address = os.environ.get("MASTER_ADDR", "?")
        return f"{address}:{os.environ.get('MASTER_PORT', '?')}"
    return init_method


def _store_host(init_method: str) -> str:
    if not init_method.startswith("env://"):
        return ""
    # torch.distributed.rendezvous: under torchrun the agent's store serves every rank.
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):
        return " (hosted by the launcher's agent)"
    return " (hosted by rank 0)"


def _expected_world(init_method: str, rank: int, world_size: int) -> tuple[str, str]:
    """(rank, world size) as this process was told them, for the messages only."""
    from_environment = init_method.startswith("env://")

    def told(value: int, variable: str) -> str:
        if value >= 0:
            return str(value)
        return os.environ.get(variable, "?") if from_environment else "?"

    return told(rank, "RANK"), told(world_size, "WORLD_SIZE")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0].rstrip(".") if text else type(error).__name__


def _limit(timeout: timedelta) -> str:
    return f"within the timeout of {timeout.total_seconds():g} s"


_ADVICE = (
    "Every rank must be started with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, reach "
    "that address, and call init_distributed within the timeout (init_distributed(timeout=...) "
    "or the DEEPSPEED_TIMEOUT environment variable, in minutes)."
)


def _arrived(store: dist.Store, world_size: int) -> list[int] | None:
    """The ranks whose arrival key is in the store; None when the store does not answer (it
    lives in rank 0's process unless a launcher's agent hosts it)."""
    try:
        store.set_timeout(_ARRIVAL_CHECK_TIMEOUT)
        return [r for r in range(world_size) if store.check([_ARRIVED_KEY.format(r)])]
    except Exception:  # noqa: BLE001 - any failure means: unknown
        return None


def _connection_failure(
    init_method: str, rank: int, world_size: int, timeout: timedelta, store, error
) -> str:
    where = _store_address(init_method)
    arrived = _arrived(store, world_size)
    if arrived is None:
        who = "the store stopped answering, so which ranks arrived is unknown"
    else:
        missing = [r for r in range(world_size) if r not in arrived]
        arrived_text = ", ".join(map(str, arrived))
        if missing:
            who = f"rank(s) {', '.join(map(str, missing))} never arrived (arrived: {arrived_text})"
        else:
            who = f"every rank arrived ({arrived_text}) but the connections between them failed"
    return (
        f"init_distributed: rank {rank} of {world_size} reached the rendezvous store at "
        f"{where}{_store_host(init_method)}, but the process group could not connect "
        f"{_limit(timeout)}: {who}. Backend error: {_first_line(error)}. {_ADVICE}"
    )


def init_process_group_named(
    backend: str,
    init_method: str,
    timeout: timedelta | None,
    *,
    rank: int = -1,
    world_size: int = -1,
) -> tuple[int, int]:
    """``dist.init_process_group(backend, init_method=..., timeout=..., rank=..., world_size=...)``
    whose failures to meet raise ``RendezvousError`` naming the store, the world size and the
    missing ranks. ``rank``/``world_size`` -1: from the URL or the environment, as torch takes
    them. Returns (rank, world size). ``timeout`` None: torch's default (its 30 minutes for the
    store)."""
    store_timeout = timeout if timeout is not None else default_pg_timeout
    given_rank, given_world = _expected_world(init_method, rank, world_size)
    try:
        # A rendezvous URL missing its rank or world size raises torch's ValueError ("rank
        # parameter missing"), which names the URL: it is left as it is.
        store, rank, world_size = next(
            dist.rendezvous(init_method, rank, world_size, timeout=store_timeout)
        )
    except (RuntimeError, TimeoutError, OSError) as error:  # torch's DistError is a RuntimeError
        raise RendezvousError(
            f"init_distributed: rank {given_rank} of {given_world} could not meet the others at "
            f"the rendezvous store {_store_address(init_method)}{_store_host(init_method)} "
            f"{_limit(store_timeout)}. Store error: {_first_line(error)}. {_ADVICE}"
        ) from error
    store.set_timeout(store_timeout)
    store.set(_ARRIVED_KEY.format(rank), "1")
    kwargs = {"backend": backend, "rank": rank, "world_size": world_size}
    if timeout is not None:
        kwargs["timeout"] = timeout
    try:
        # The prefix init_process_group gives a store it made itself (so that other users of a
        # shared store, such as RPC, never see the group's keys).
        dist.init_process_group(store=dist.PrefixStore("default_pg", store), **kwargs)
    except RuntimeError as error:
        message = _connection_failure(init_method, rank, world_size, store_timeout, store, error)
        raise RendezvousError(message) from error
    return rank, world_size
