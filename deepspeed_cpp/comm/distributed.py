"""Process-group initialisation from torchrun's environment, or a world of one without it."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch.distributed as dist

from ..utils.logging import logger
from .collective_errors import named_collective, set_configured_timeout
from .rendezvous import init_process_group_named

_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _resolve_timeout(timeout) -> timedelta | None:
    if timeout is None:
        minutes = os.environ.get("DEEPSPEED_TIMEOUT")
        if not minutes:
            return None
        try:
            # DeepSpeed reads whole minutes; a fraction is accepted here (tests, short jobs).
            timeout = timedelta(minutes=float(minutes))
        except ValueError:
            raise ValueError(
                f"DEEPSPEED_TIMEOUT must be a number of minutes, got {minutes!r}"
            ) from None
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = timedelta(seconds=timeout)
    if not isinstance(timeout, timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"init_distributed: timeout must be a positive timedelta, got {timeout!r}")
    return timeout


def _uses_environment(init_method: str | None) -> bool:
    return init_method is None or init_method.startswith("env://")


def _prepare_environment(rank: int, world_size: int, distributed_port: int | None, verbose: bool):
    """For ``env://``: torch reads the store's address (and, unless given as arguments, rank and
    world size) from the environment; fill in what a script without a launcher leaves out."""
    present = [name for name in _LAUNCHER_VARIABLES if os.environ.get(name)]
    if rank >= 0 and world_size > 0:
        # The rank and world size go to torch as arguments (they win over RANK/WORLD_SIZE);
        # only the store's address can come from nowhere else.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(distributed_port or 29500))
    elif not present:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(distributed_port or _free_port()),
        )
        if verbose:
            logger.info("deepspeed_cpp: no launcher environment found; using a world of one")
    elif len(present) < len(_LAUNCHER_VARIABLES):
        missing = [name for name in _LAUNCHER_VARIABLES if name not in present]
        raise RuntimeError(
            f"init_distributed: the launcher environment is incomplete: {', '.join(present)} "
            f"set but {', '.join(missing)} missing (launch with torchrun or deepspeed-cpp)"
        )


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int | None = None,
    verbose: bool = True,
    timeout: timedelta | float | None = None,
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config=None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Initialises the default process group once (DeepSpeed's signature; MPI is not used).

    ``init_method`` takes every URL ``torch.distributed.init_process_group`` takes, with
    ``rank`` and ``world_size`` passed on to torch as arguments: ``file:///path`` and
    ``tcp://host:port`` need them (as arguments or in the URL's query, ``?rank=0&world_size=2``),
    ``env://`` takes them over RANK/WORLD_SIZE.

    Without ``init_method`` (or with ``env://``): under torchrun (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT set) the group comes from that environment; with ``rank`` and ``world_size``
    given, MASTER_ADDR/MASTER_PORT default to loopback and ``distributed_port`` (29500); with
    none of them — a notebook or a plain ``python script.py`` — a world of one is created on
    loopback. Partly set variables are an error naming the missing ones. The backend defaults to
    the accelerator's (gloo on CPU, nccl on CUDA).

    ``timeout`` bounds every collective (a ``timedelta``, or seconds); without it, DeepSpeed's
    ``DEEPSPEED_TIMEOUT`` environment variable (minutes), else torch's default. A rank that does
    not answer within it makes the others raise ``CollectiveTimeoutError`` naming the
    collective and the silent rank (``collective_errors.py``). It bounds the rendezvous too: a
    rank that never arrives, or a wrong MASTER_ADDR/MASTER_PORT, makes the others raise
    ``RendezvousError`` naming the store and the missing ranks (``rendezvous.py``). DeepSpeed
    has no ds_config key for it (its ``comms_config`` holds only ``comms_logger``), so neither
    do we.
    """
    if dist.is_initialized():
        return
    if dist_init_required is False:
        return
    if _uses_environment(init_method):
        _prepare_environment(rank, world_size, distributed_port, verbose)
    if dist_backend is None:
        from ..accelerator import get_accelerator

        dist_backend = get_accelerator().communication_backend_name()
    timeout = _resolve_timeout(timeout)
    init_process_group_named(
        dist_backend, init_method or "env://", timeout, rank=rank, world_size=world_size
    )
    set_configured_timeout(timeout)
    if verbose and dist.get_rank() == 0:
        logger.info(
            "deepspeed_cpp: initialised %s process group, world size %d",
            dist_backend,
            dist.get_world_size(),
        )


def destroy_process_group(group=None) -> None:
    """Destroys ``group`` (default: the default group and every other). After destroying the
    default group, ``init_distributed`` may be called again in the same process."""
    if not dist.is_initialized():
        return
    if group is None:
        set_configured_timeout(None)
        dist.destroy_process_group()
    else:
        dist.destroy_process_group(group)


def is_initialized() -> bool:
    return dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier(group=None) -> None:
    if dist.is_initialized():
        with named_collective("barrier"):
            dist.barrier(group)
