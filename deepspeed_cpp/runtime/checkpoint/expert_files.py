"""The per-expert files of a checkpoint of a Mixture-of-Experts model (DeepSpeed's layout).

```
<tag>/layer_<L>_expert_<E>_mp_rank_00_model_states.pt   expert E (global index) of MoE layer L:
                                                         {global parameter name: tensor}
```

The module-states file holds everything else (dense parameters, buffers, gate weights). Expert E
is held by every rank of one expert-data-parallel group; the first rank of that group writes its
file, once. Each file is listed in ``checkpoint_meta.json`` with its size and SHA-256 like every
other file, and the metadata's ``"moe"`` entry records each layer's ``num_experts`` and the
``ep_size`` it was saved with: a model with another ``ep_size`` or world size finds its experts
by their global names (``deepspeed_cpp.moe.expert_names``); one with another ``num_experts`` is
refused.
"""

from __future__ import annotations

from pathlib import Path

from ...moe.expert_names import ExpertLayer, split_expert_name
from ...utils import groups
from .errors import CheckpointMismatchError, IncompleteCheckpointError
from .shard_reader import load_mapped

EXPERT_ROLE = "expert"


def expert_file(layer: int, expert: int) -> str:
    """DeepSpeed's name of the file of global expert ``expert`` of MoE layer ``layer``."""
    return f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt"


def moe_metadata(layers: list[ExpertLayer]) -> dict | None:
    """The metadata's ``"moe"`` entry (None for a model without MoE layers)."""
    if not layers:
        return None
    return {
        "ep_size": max(layer.ep_size for layer in layers),
        "layers": [layer.to_json() for layer in layers],
    }


def without_experts(state_dict: dict, layers: list[ExpertLayer]) -> dict:
    """``state_dict`` less its expert entries: what the module-states file holds."""
    return {k: v for k, v in state_dict.items() if split_expert_name(k, layers) is None}


def _writes_experts(layer: ExpertLayer, rank: int) -> bool:
    """Whether this rank is the first of the expert-data-parallel group holding its experts."""
    if layer.ep_size == 1:
        return rank == 0
    return groups._get_expert_broadcast_src_rank(layer.group_name) == rank


def expert_payloads(global_state: dict, layers: list[ExpertLayer], rank: int):
    """``(file name, role, {global name: tensor})`` of every expert file this rank writes;
    ``global_state`` is this rank's state dict under global names."""
    by_file: dict[tuple[int, int], dict] = {}
    for name, value in global_state.items():
        parts = split_expert_name(name, layers)
        if parts is not None and _writes_experts(parts[0], rank):
            by_file.setdefault((parts[0].index, parts[1]), {})[name] = value
    for (layer, expert), payload in sorted(by_file.items()):
        yield expert_file(layer, expert), f"{EXPERT_ROLE} {expert} of MoE layer {layer}", payload


def check_experts_match(metadata: dict, layers: list[ExpertLayer]) -> None:
    """Refuses a checkpoint whose MoE layers differ in number or ``num_experts`` from the
    model's; another ``ep_size`` is fine (experts are found by global name)."""
    saved = (metadata.get("moe") or {}).get("layers", [])
    if not saved:
        return  # no MoE layers, or saved before expert files: experts are in the module file
    if len(saved) != len(layers):
        raise CheckpointMismatchError(
            f"the checkpoint has {len(saved)} MoE layer(s) "
            f"{[entry['module'] for entry in saved]}, the model has {len(layers)} "
            f"{[layer.module_name for layer in layers]}"
        )
    for entry, layer in zip(saved, layers):
        if entry["num_experts"] != layer.num_experts:
            raise CheckpointMismatchError(
                f"MoE layer {layer.index} ('{layer.module_name}'): the checkpoint has "
                f"num_experts={entry['num_experts']}, the model has "
                f"num_experts={layer.num_experts}; experts cannot be added or removed by "
                f"loading (ep_size may differ: the checkpoint's is {entry['ep_size']}, the "
                f"model's {layer.ep_size})"
            )


def check_deepspeed_experts_match(num_experts, layers: list[ExpertLayer], directory) -> None:
    """Refuses a DeepSpeed checkpoint whose MoE layers (its model states' ``num_experts``, one
    count per layer) differ from the model's."""
    saved = list(num_experts or [])
    if saved != [layer.num_experts for layer in layers]:
        raise CheckpointMismatchError(
            f"the DeepSpeed checkpoint {directory} has MoE layers with num_experts={saved}, the "
            f"model {[layer.num_experts for layer in layers]} "
            f"({[layer.module_name for layer in layers]}); experts cannot be added or removed "
            "by loading"
        )


def read_expert_states(
    directory: Path, metadata: dict, digests: dict, wanted=lambda layer, expert: True
) -> dict:
    """The saved expert tensors (global names) of the experts ``wanted(layer, expert)`` says,
    each file checked against its SHA-256 as it is read."""
    state: dict = {}
    saved = (metadata.get("moe") or {}).get("layers", [])
    for entry in saved:
        for expert in range(entry["num_experts"]):
            if wanted(entry["layer"], expert):
                name = expert_file(entry["layer"], expert)
                if name not in digests:
                    raise IncompleteCheckpointError(
                        f"checkpoint {directory} is incomplete: {name} (expert {expert} of MoE "
                        f"layer {entry['layer']}) is not among the files checkpoint_meta.json "
                        f"lists"
                    )
                state.update(load_mapped(directory / name, digests.get(name), "expert file"))
    return state


def wanted_by(layers: list[ExpertLayer]):
    """``wanted`` for ``read_expert_states``: the experts this rank holds."""

    def wanted(layer: int, expert: int) -> bool:
        return expert in layers[layer].local_experts()

    return wanted
