"""``deepspeed.comm.configure`` and ``deepspeed.comm.log_summary``: the comms logger's switches."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed import distributed_c10d

from . import collective_tap
from .comms_logger import comms_logger


def configure(
    deepspeed_config=None,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Sets the comms logger from a config's ``comms_logger`` section and/or the keywords (the
    engine calls it with its config, as DeepSpeed's does); collectives are wrapped only while it
    is enabled."""
    if deepspeed_config is not None:
        comms_logger.configure(getattr(deepspeed_config, "comms_logger", deepspeed_config))
    for name, value in (
        ("enabled", enabled),
        ("prof_all", prof_all),
        ("prof_ops", prof_ops),
        ("verbose", verbose),
        ("debug", debug),
    ):
        if value is not None:
            setattr(comms_logger, name, list(value) if name == "prof_ops" else bool(value))
    if comms_logger.enabled:
        collective_tap.install()
    else:
        collective_tap.uninstall()


def log_summary(show_straggler: bool = False, return_dict: bool = False):
    """Prints the table of every collective recorded on rank 0 (collective: every rank calls
    it). ``show_straggler`` is accepted for DeepSpeed's signature; each rank's own numbers are in
    ``comms_logger.summary()``. With ``return_dict`` the summary is returned."""
    initialized = dist.is_available() and dist.is_initialized()
    if initialized:
        distributed_c10d.barrier()  # torch's own: the summary's barrier is not counted
    if not initialized or dist.get_rank() == 0:
        comms_logger.log_all(print_log=True)
    if initialized:
        distributed_c10d.barrier()
    return comms_logger.summary() if return_dict else None
