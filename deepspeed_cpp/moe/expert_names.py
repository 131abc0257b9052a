"""Global names of expert parameters: what makes a checkpoint independent of ``ep_size``.

A rank of an expert-parallel group of ``ep_size`` ranks holds ``num_experts // ep_size`` experts
of each MoE layer, named ``<layer>.deepspeed_moe.experts.deepspeed_experts.<i>.<rest>`` with a
*local* index ``i``. Rank ``r`` of the group holds the global experts ``r * local + i`` (the
order in which the all-to-all hands out token chunks). Checkpoints, consolidated state dicts and
``save_16bit_model`` name every expert by its *global* index, as DeepSpeed's per-expert files do,
so that a model with another ``ep_size`` (or another world size) finds its experts by name.
With ``ep_size`` 1 local and global names are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..utils import groups
from .layer import MoE

EXPERTS_PATH = "deepspeed_moe.experts.deepspeed_experts"


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer of a model, as this rank holds it."""

    index: int  # L: its place among the model's MoE layers (DeepSpeed's moe_layer_id)
    module_name: str  # its name in the model ("" for the model itself)
    num_experts: int
    ep_size: int
    ep_rank: int  # this rank's place in its expert-parallel group
    group_name: str

    @property
    def prefix(self) -> str:
        """What every expert parameter's name starts with, before the expert index."""
        return f"{self.module_name}.{EXPERTS_PATH}." if self.module_name else f"{EXPERTS_PATH}."

    @property
    def num_local(self) -> int:
        return self.num_experts // self.ep_size

    def local_experts(self) -> range:
        """The global indices of the experts this rank holds."""
        return range(self.ep_rank * self.num_local, (self.ep_rank + 1) * self.num_local)

    def to_json(self) -> dict:
        return {
            "layer": self.index,
            "module": self.module_name,
            "num_experts": self.num_experts,
            "ep_size": self.ep_size,
            "group_name": self.group_name,
        }


def expert_layers(module: torch.nn.Module) -> list[ExpertLayer]:
    """The MoE layers of ``module`` in ``named_modules`` order (every rank sees the same)."""
    found = []
    for name, sub in module.named_modules():
        if isinstance(sub, MoE):
            ep_rank = 0
            if sub.ep_size > 1:
                ep_rank = groups._get_expert_parallel_rank(sub.expert_group_name)
            found.append(
                ExpertLayer(
                    len(found), name, sub.num_experts, sub.ep_size, ep_rank, sub.expert_group_name
                )
            )
    return found


def split_expert_name(name: str, layers: list[ExpertLayer]) -> tuple[ExpertLayer, int, str] | None:
    """``(layer, index, rest)`` when ``name`` is ``<layer prefix><index>.<rest>``, else None."""
    for layer in layers:
        if name.startswith(layer.prefix):
            index, _, rest = name[len(layer.prefix) :].partition(".")
            if index.isdigit() and rest:
                return layer, int(index), rest
    return None


def global_name(name: str, layers: list[ExpertLayer]) -> str:
    """The global name of this rank's ``name`` (unchanged when it is not an expert's)."""
    parts = split_expert_name(name, layers)
    if parts is None:
        return name
    layer, local, rest = parts
    return f"{layer.prefix}{layer.ep_rank * layer.num_local + local}.{rest}"


def local_name(name: str, layers: list[ExpertLayer]) -> str | None:
    """This rank's name for the global ``name``; None for an expert another rank holds (or
    one past the layer's ``num_experts``)."""
    parts = split_expert_name(name, layers)
    if parts is None:
        return name
    layer, index, rest = parts
    if index not in layer.local_experts():
        return None
    return f"{layer.prefix}{index - layer.ep_rank * layer.num_local}.{rest}"


def to_global(state_dict: dict, layers: list[ExpertLayer]) -> dict:
    """``state_dict`` (this rank's names) with every expert entry under its global name."""
    return {global_name(name, layers): value for name, value in state_dict.items()}


def to_local(state_dict: dict, layers: list[ExpertLayer]) -> dict:
    """The entries of a globally named ``state_dict`` that this rank holds, under its names."""
    local = {}
    for name, value in state_dict.items():
        mine = local_name(name, layers)
        if mine is not None:
            local[mine] = value
    return local


def gather_experts_to_rank0(module: torch.nn.Module, state_dict: dict) -> dict:
    """On rank 0: ``state_dict`` (this rank's, whole parameters) with every expert of every
    layer under its global name; collective over rank 0's expert-parallel groups (the other
    ranks take part where they belong to one and get ``{}``).

    Rank 0's expert-parallel group of a layer holds all its experts between its members; each
    local expert's tensors are all-gathered in that group, in one fixed order on every member.
    """
    layers = expert_layers(module)
    rank = dist.get_rank() if dist.is_initialized() else 0
    result = to_global(state_dict, layers) if rank == 0 else {}
    for layer in layers:
        if layer.ep_size == 1:
            continue
        group = groups._get_expert_parallel_group(layer.group_name)
        members = dist.get_process_group_ranks(group)
        if 0 not in members:
            continue
        names = sorted(n for n in state_dict if n.startswith(layer.prefix))
        for name in names:
            tensor = state_dict[name].detach().contiguous()
            pieces = [torch.empty_like(tensor) for _ in members]
            dist.all_gather(pieces, tensor, group=group)
            if rank == 0:
                _, local, rest = split_expert_name(name, layers)
                for ep_rank, piece in enumerate(pieces):
                    result[f"{layer.prefix}{ep_rank * layer.num_local + local}.{rest}"] = piece
    return result
