"""DeepSpeed's ``deepspeed.utils.groups``: the expert-parallel and expert-data-parallel process
groups of Mixture-of-Experts layers, created once per ``ep_size`` and named ``ep_size_<n>``.

With ``world_size`` ranks and ``ep_size`` experts-parallel ranks (DeepSpeed's default layout,
``use_data_before_expert_parallel_=False``):

- expert-parallel groups are consecutive ranks ``[i * ep_size, (i + 1) * ep_size)``: the ranks
  among which one layer's experts are split and tokens are exchanged (all-to-all);
- expert-data-parallel groups are the ranks with the same index modulo ``ep_size``: the ranks
  holding copies of the same experts, whose gradients are averaged together.

With ``use_data_before_expert_parallel_=True`` the roles are swapped: expert-data-parallel groups
are consecutive blocks of ``world_size // ep_size`` ranks and expert-parallel groups are strided.
Every rank must create the groups at the same point, in the same order (``new_group`` is
collective).

``mpu`` is DeepSpeed's model-parallel unit (``get_{data,model}_parallel_{group,rank,world_size}``):
``initialize(mpu=...)`` registers it here (``set_model_parallel_unit``), and the data- and
model-parallel accessors below answer from it; without one, data parallelism spans the world
and the model-parallel size is 1.
"""

from __future__ import annotations

import torch.distributed as dist

from ..comm.collective_errors import new_group
from ..comm.entry_agreement import agree_on_entries
from .logging import logger

# Group objects this rank belongs to, by name ("ep_size_<n>").
_EXPERT_PARALLEL_GROUP: dict = {}
_EXPERT_DATA_PARALLEL_GROUP: dict = {}
# DeepSpeed's model-parallel unit, registered by initialize(mpu=...); None: data parallel only.
mpu = None


def expert_group_name(ep_size: int) -> str:
    """The name DeepSpeed gives the groups (and the expert parameters' ``group_name``)."""
    return f"ep_size_{ep_size}"


def _allowed_ep_sizes(world_size: int) -> list[int]:
    return [d for d in range(1, world_size + 1) if world_size % d == 0]


def check_expert_parallel_size(ep_size: int, world_size: int, who: str = "ep_size") -> None:
    """Raises ValueError unless ``ep_size`` is a positive divisor of ``world_size``."""
    if not isinstance(ep_size, int) or ep_size < 1 or world_size % ep_size != 0:
        larger = (
            " is larger than the world size"
            if isinstance(ep_size, int) and ep_size > world_size
            else ""
        )
        raise ValueError(
            f"{who}={ep_size!r}{larger}: the expert-parallel size must divide the world size "
            f"{world_size}; allowed values: {', '.join(map(str, _allowed_ep_sizes(world_size)))}"
        )


def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
) -> None:
    """Creates (once per size) the expert-parallel and expert-data-parallel groups of this size."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"expert-parallel groups (ep_size={expert_parallel_size_}) need torch.distributed: "
            "call deepspeed_cpp.init_distributed() first"
        )
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    check_expert_parallel_size(expert_parallel_size_, world_size)
    name = expert_group_name(expert_parallel_size_)
    ep = expert_parallel_size_
    dp = world_size // ep  # copies of each expert
    if name not in _EXPERT_DATA_PARALLEL_GROUP or name not in _EXPERT_PARALLEL_GROUP:
        _agree_on_layout(ep, use_data_before_expert_parallel_)
    if name not in _EXPERT_DATA_PARALLEL_GROUP:
        for i in range(ep):
            if use_data_before_expert_parallel_:
                ranks = list(range(i * dp, (i + 1) * dp))
            else:
                ranks = list(range(i, world_size, ep))
            group = new_group(ranks)
            if rank in ranks:
                _EXPERT_DATA_PARALLEL_GROUP[name] = group
                logger.info("deepspeed_cpp: expert-data-parallel group %s: ranks %s", name, ranks)
    if name not in _EXPERT_PARALLEL_GROUP:
        for i in range(dp):
            if use_data_before_expert_parallel_:
                ranks = list(range(i, world_size, dp))
            else:
                ranks = list(range(i * ep, (i + 1) * ep))
            group = new_group(ranks)
            if rank in ranks:
                _EXPERT_PARALLEL_GROUP[name] = group
                logger.info("deepspeed_cpp: expert-parallel group %s: ranks %s", name, ranks)


def _agree_on_layout(ep_size: int, use_data_before_expert_parallel_: bool) -> None:
    """``new_group`` is collective: ranks making groups of other sizes or layouts (an MoE
    layer with another ep_size on one rank) would pair mismatched rank lists or wait forever.
    They agree first, and every rank raises RankDisagreementError naming the values."""
    from ..accelerator import get_accelerator

    agree_on_entries(
        [
            ("ep_size", str(ep_size)),
            ("use_data_before_expert_parallel_", str(bool(use_data_before_expert_parallel_))),
        ],
        what="creating the expert-parallel process groups (MoE layer construction)",
        advice="every rank must build the same MoE layers",
        device=get_accelerator().current_device_name(),
    )


def _lookup(groups: dict, name: str, kind: str):
    if name not in groups:
        known = ", ".join(sorted(groups)) or "none yet"
        raise KeyError(
            f"no {kind} group named {name!r} (created: {known}); groups are created by "
            "MoE layers (MoE.set_deepspeed_parallelism) or _create_expert_and_data_parallel"
        )
    return groups[name]


def _get_expert_parallel_group(group_name: str):
    return _lookup(_EXPERT_PARALLEL_GROUP, group_name, "expert-parallel")


def _get_expert_parallel_group_dict() -> dict:
    return _EXPERT_PARALLEL_GROUP


def _get_expert_data_parallel_group(group_name: str):
    return _lookup(_EXPERT_DATA_PARALLEL_GROUP, group_name, "expert-data-parallel")


def _get_expert_data_parallel_group_dict() -> dict:
    return _EXPERT_DATA_PARALLEL_GROUP


def _get_expert_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return dist.get_world_size(group=_get_expert_data_parallel_group(group_name))


def _get_expert_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_parallel_group(group_name))


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return dist.get_rank(group=_get_expert_data_parallel_group(group_name))


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """The global rank of the first rank of this rank's expert-data-parallel group."""
    return min(dist.get_process_group_ranks(_get_expert_data_parallel_group(group_name)))


def _get_expert_parallel_ranks(group_name: str) -> list[int]:
    return dist.get_process_group_ranks(_get_expert_parallel_group(group_name))


def _get_max_expert_size() -> int:
    """The largest ep_size of the groups created so far (1 when none)."""
    sizes = [int(name.rsplit("_", 1)[1]) for name in _EXPERT_PARALLEL_GROUP]
    return max(sizes, default=1)


def _get_max_expert_size_name() -> str:
    return expert_group_name(_get_max_expert_size())


def set_model_parallel_unit(mpu_) -> None:
    """Registers DeepSpeed's ``mpu`` (or None to forget it): the accessors below answer from
    it. ``initialize(mpu=...)`` calls it; pipeline and tensor-parallel set-ups may call it
    earlier so that code built before the engine (layers, ``deepspeed.checkpointing``) sees it."""
    global mpu
    mpu = mpu_


def _get_data_parallel_group():
    return mpu.get_data_parallel_group() if mpu is not None else dist.group.WORLD


def _get_data_parallel_world_size() -> int:
    if mpu is not None:
        return mpu.get_data_parallel_world_size()
    return dist.get_world_size() if dist.is_initialized() else 1


def _get_data_parallel_rank() -> int:
    if mpu is not None:
        return mpu.get_data_parallel_rank()
    return dist.get_rank() if dist.is_initialized() else 0


def _get_data_parallel_group_ranks() -> list[int]:
    """The global ranks of this rank's data-parallel group."""
    if mpu is not None and hasattr(mpu, "get_data_parallel_group_ranks"):
        return list(mpu.get_data_parallel_group_ranks())
    if mpu is not None:
        return dist.get_process_group_ranks(mpu.get_data_parallel_group())
    return list(range(dist.get_world_size() if dist.is_initialized() else 1))


def _get_broadcast_src_rank() -> int:
    """The global rank of the first rank of this rank's data-parallel group."""
    return min(_get_data_parallel_group_ranks())


def _get_model_parallel_group():
    """This rank's model-parallel group; None without an mpu (no model parallelism)."""
    return mpu.get_model_parallel_group() if mpu is not None else None


def _get_model_parallel_world_size() -> int:
    return mpu.get_model_parallel_world_size() if mpu is not None else 1


def _get_model_parallel_rank() -> int:
    return mpu.get_model_parallel_rank() if mpu is not None else 0


def _get_expert_model_parallel_world_size() -> int:
    return 1


def _reset_for_tests() -> None:
    """Forgets every group (the process groups themselves stay alive)."""
    _EXPERT_PARALLEL_GROUP.clear()
    _EXPERT_DATA_PARALLEL_GROUP.clear()
    set_model_parallel_unit(None)
