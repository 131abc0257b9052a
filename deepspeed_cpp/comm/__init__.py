"""``deepspeed_cpp.comm``: process-group set-up and the few collective helpers scripts call.

Everything here is a thin layer over ``torch.distributed``; rendezvous is torchrun's (or, with no
launcher at all, a world of one on loopback).
"""

from .collective_errors import CollectiveTimeoutError
from .distributed import (
    barrier,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)
from .entry_agreement import RankDisagreementError
from .rendezvous import RendezvousError

__all__ = [
    "CollectiveTimeoutError",
    "RankDisagreementError",
    "RendezvousError",
    "barrier",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "init_distributed",
    "is_initialized",
]
