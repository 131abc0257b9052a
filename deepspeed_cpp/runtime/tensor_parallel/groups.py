"""The tensor × data-parallel process groups of AutoTP training, and the ``mpu`` exposing them.

DeepSpeed's layout: with ``world_size`` ranks and TP size ``tp``, tensor-parallel groups are
consecutive ranks ``[i * tp, (i + 1) * tp)`` (on one node where possible: they exchange
activations every layer) and data-parallel groups are the ranks with the same index modulo
``tp`` (they hold the same slices and average gradients). ``ModelParallelUnit`` answers
Megatron's ``mpu`` questions (``get_{tensor_,}model_parallel_{group,rank,world_size}``,
``get_data_parallel_{group,rank,world_size}``) that DeepSpeed and its users ask.

``new_group`` is collective: every rank builds every group, in the same order; the groups of a
size are built once per process and reused by later engines.
"""

from __future__ import annotations

import torch.distributed as dist

from ...comm.collective_errors import new_group
from ...utils.logging import logger

_UNITS: dict[int, ModelParallelUnit] = {}


class ModelParallelUnit:
    """The TP and DP groups of this rank for one TP size (see the module docstring)."""

    def __init__(self, tp_size: int):
        world, rank = dist.get_world_size(), dist.get_rank()
        check_tensor_parallel_size(tp_size, world)
        self.tp_size = tp_size
        self.dp_size = world // tp_size
        self._tp_group = self._dp_group = None
        self._tp_ranks = self._dp_ranks = None
        for i in range(self.dp_size):
            ranks = list(range(i * tp_size, (i + 1) * tp_size))
            group = new_group(ranks)
            if rank in ranks:
                self._tp_group, self._tp_ranks = group, ranks
        for j in range(tp_size):
            ranks = list(range(j, world, tp_size))
            group = new_group(ranks)
            if rank in ranks:
                self._dp_group, self._dp_ranks = group, ranks
        logger.info(
            "deepspeed_cpp: rank %d: tensor-parallel ranks %s, data-parallel ranks %s",
            rank,
            self._tp_ranks,
            self._dp_ranks,
        )

    # Megatron's names: model parallelism here is tensor parallelism.
    def get_tensor_model_parallel_group(self):
        return self._tp_group

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.tp_size

    def get_tensor_model_parallel_rank(self) -> int:
        return self._tp_ranks.index(dist.get_rank())

    def get_tensor_model_parallel_src_rank(self) -> int:
        """The global rank of this TP group's first rank."""
        return self._tp_ranks[0]

    def get_tensor_model_parallel_ranks(self) -> list[int]:
        return list(self._tp_ranks)

    get_model_parallel_group = get_tensor_model_parallel_group
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_src_rank = get_tensor_model_parallel_src_rank

    def get_data_parallel_group(self):
        return self._dp_group

    def get_data_parallel_world_size(self) -> int:
        return self.dp_size

    def get_data_parallel_rank(self) -> int:
        return self._dp_ranks.index(dist.get_rank())

    def get_data_parallel_src_rank(self) -> int:
        """The global rank of this DP group's first rank."""
        return self._dp_ranks[0]

    def get_data_parallel_ranks(self) -> list[int]:
        return list(self._dp_ranks)

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0


def check_tensor_parallel_size(tp_size, world_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel.autotp_size = {tp_size!r}: expected a positive integer")
    if world_size % tp_size != 0:
        allowed = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"tensor_parallel.autotp_size = {tp_size} does not divide the world size "
            f"{world_size}: expected one of {allowed}"
        )


def model_parallel_unit(tp_size: int) -> ModelParallelUnit:
    """This rank's groups for ``tp_size`` (built on first use; collective then)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "tensor-parallel groups need torch.distributed: call deepspeed_cpp.init_distributed()"
        )
    if tp_size not in _UNITS:
        _UNITS[tp_size] = ModelParallelUnit(tp_size)
    return _UNITS[tp_size]
