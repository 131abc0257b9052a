"""``deepspeed_cpp.comm``: process-group set-up and the few collective helpers scripts call.

Everything here is a thin layer over ``torch.distributed``; rendezvous is torchrun's (or, with no
launcher at all, a world of one on loopback).
"""

from .collective_errors import CollectiveTimeoutError, new_group
from .collectives import (
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    broadcast,
    get_backend,
    get_global_rank,
    get_world_group,
    has_all_gather_into_tensor,
    has_reduce_scatter_tensor,
    inference_all_reduce,
    is_available,
    reduce,
    reduce_scatter_tensor,
)
from .comms_logger import comms_logger
from .distributed import (
    barrier,
    destroy_process_group,
    get_local_rank,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
)
from .entry_agreement import RankDisagreementError
from .logging_api import configure, log_summary
from .rendezvous import RendezvousError

__all__ = [
    "CollectiveTimeoutError",
    "ReduceOp",
    "RankDisagreementError",
    "RendezvousError",
    "all_gather",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "comms_logger",
    "configure",
    "destroy_process_group",
    "get_backend",
    "get_global_rank",
    "get_local_rank",
    "get_rank",
    "get_world_group",
    "get_world_size",
    "has_all_gather_into_tensor",
    "has_reduce_scatter_tensor",
    "inference_all_reduce",
    "init_distributed",
    "is_available",
    "is_initialized",
    "log_summary",
    "new_group",
    "reduce",
    "reduce_scatter_tensor",
]
