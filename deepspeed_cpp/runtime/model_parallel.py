"""The ``mpu`` of ``initialize()``: which ranks are data-parallel replicas of each other and
which hold other parts (slices, stages) of one model.

DeepSpeed's protocol (Megatron's ``mpu``): an object with ``get_data_parallel_{group,rank,
world_size}()`` and ``get_model_parallel_{group,rank,world_size}()``. The engine then

- reduces gradients, shards ZeRO state, broadcasts the initial weights (from the data-parallel
  group's first rank) and splits the data over the data-parallel group only, and takes the
  batch-size rule's world size from it;
- takes the gradient norm (clipping, the non-finite check) over the whole model: each rank's
  partial sum of squares is summed over the data-parallel group and then over the model-parallel
  group, a parameter that every model-parallel rank holds whole (not marked ``model_parallel``
  or ``tensor_model_parallel``, DeepSpeed's marks for split ones) counted on model-parallel rank
  0 only, so every rank of the world sees the same norm and skips the same steps;
- writes each model-parallel rank's checkpoint under a folder of its own (``checkpoint/layout.py``).

``ModelParallelGroups`` is the one place the engine, its ZeRO stage and the checkpoint layer read
these groups from; without an mpu it describes plain data parallelism over the whole world.
The pipeline and tensor-parallel engines build an mpu (or register one with
``deepspeed_cpp.utils.groups.set_model_parallel_unit``) and pass it to ``initialize()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..utils import groups

# What the engine calls on an mpu (DeepSpeed's names).
REQUIRED_METHODS = tuple(
    f"get_{kind}_parallel_{what}"
    for kind in ("data", "model")
    for what in ("group", "rank", "world_size")
)


def is_model_parallel_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is split across the model-parallel ranks (each holds another part),
    DeepSpeed's marks: ``param.model_parallel`` or ``param.tensor_model_parallel`` true."""
    return bool(getattr(param, "model_parallel", False)) or bool(
        getattr(param, "tensor_model_parallel", False)
    )


def check_mpu(mpu) -> None:
    """Raises TypeError naming the methods an mpu lacks, ValueError when its sizes do not
    multiply to (at most) the world or its ranks are out of range."""
    missing = [name for name in REQUIRED_METHODS if not callable(getattr(mpu, name, None))]
    if missing:
        raise TypeError(
            f"initialize(mpu=...): {type(mpu).__name__} lacks {', '.join(missing)}; an mpu "
            f"needs {', '.join(name + '()' for name in REQUIRED_METHODS)}"
        )
    world = dist.get_world_size()
    for kind in ("data", "model"):
        size = getattr(mpu, f"get_{kind}_parallel_world_size")()
        rank = getattr(mpu, f"get_{kind}_parallel_rank")()
        group = getattr(mpu, f"get_{kind}_parallel_group")()
        if not isinstance(size, int) or size < 1 or world % size != 0:
            raise ValueError(
                f"initialize(mpu=...): get_{kind}_parallel_world_size() returned {size!r}; "
                f"expected a positive divisor of the world size {world}"
            )
        if not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(
                f"initialize(mpu=...): get_{kind}_parallel_rank() returned {rank!r}; expected "
                f"0 <= rank < get_{kind}_parallel_world_size() = {size}"
            )
        if group is not None and dist.get_world_size(group) != size:
            raise ValueError(
                f"initialize(mpu=...): get_{kind}_parallel_group() has "
                f"{dist.get_world_size(group)} ranks but get_{kind}_parallel_world_size() "
                f"returned {size}"
            )
    data, model = mpu.get_data_parallel_world_size(), mpu.get_model_parallel_world_size()
    if data * model > world:
        raise ValueError(
            f"initialize(mpu=...): data-parallel size {data} x model-parallel size {model} = "
            f"{data * model} exceeds the world size {world}"
        )


@dataclass(frozen=True)
class ModelParallelGroups:
    """This rank's data-parallel and model-parallel groups, ranks and sizes. ``mp_group`` is
    None when the model-parallel size is 1 (nothing to sum the norm over)."""

    dp_group: dist.ProcessGroup
    dp_rank: int
    dp_world_size: int
    mp_group: dist.ProcessGroup | None
    mp_rank: int
    mp_world_size: int
    tensor_rank: int = 0  # the tensor-parallel rank (a pipeline's slice; else mp_rank)

    @classmethod
    def from_mpu(cls, mpu) -> ModelParallelGroups:
        """From ``mpu`` (checked by ``check_mpu``), or plain data parallelism when None."""
        if mpu is None:
            return cls(dist.group.WORLD, dist.get_rank(), dist.get_world_size(), None, 0, 1)
        check_mpu(mpu)
        mp_world_size = mpu.get_model_parallel_world_size()
        dp_group = mpu.get_data_parallel_group()
        return cls(
            dp_group=dp_group if dp_group is not None else dist.group.WORLD,
            dp_rank=mpu.get_data_parallel_rank(),
            dp_world_size=mpu.get_data_parallel_world_size(),
            mp_group=mpu.get_model_parallel_group() if mp_world_size > 1 else None,
            mp_rank=mpu.get_model_parallel_rank(),
            mp_world_size=mp_world_size,
            tensor_rank=_tensor_rank(mpu),
        )

    @property
    def broadcast_src(self) -> int:
        """The global rank of the data-parallel group's first rank (the initial weights' source)."""
        return dist.get_global_rank(self.dp_group, 0)

    def counts_in_norm(self, param: torch.Tensor) -> bool:
        """Whether this rank adds ``param``'s gradient to the whole model's norm: split
        parameters everywhere, replicated ones on model-parallel rank 0 only."""
        pipe_replicated = getattr(param, "ds_pipe_replicated", None)
        if pipe_replicated is not None:
            # A pipeline stage's parameter (runtime/pipe/module.py): every stage holds other
            # layers; a tied weight's copies after its first stage are marked replicated, and
            # within a stage an unsplit parameter is held by every tensor-parallel slice.
            if pipe_replicated:
                return False
            return self.tensor_rank == 0 or is_model_parallel_parameter(param)
        return self.mp_rank == 0 or is_model_parallel_parameter(param)


def _tensor_rank(mpu) -> int:
    """The tensor-parallel rank, by the first of DeepSpeed's names ``mpu`` has (a pipeline
    grid's "model" rank spans its stages too: its slice rank is the tensor one)."""
    for name in ("get_tensor_model_parallel_rank", "get_slice_parallel_rank"):
        if hasattr(mpu, name):
            return getattr(mpu, name)()
    return mpu.get_model_parallel_rank()


def register(mpu) -> None:
    """Makes ``mpu`` the one ``deepspeed_cpp.utils.groups`` answers from (DeepSpeed sets
    ``groups.mpu`` in ``initialize()`` too)."""
    groups.set_model_parallel_unit(mpu)
