"""Reads a DeepSpeed checkpoint folder into plain data deepspeed_cpp's loader applies.

The model-states file gives the module's buffers (and frozen parameters), the counters, the LR
scheduler's state and the client state (DeepSpeed stores the ``client_state`` dict's keys beside
its own; every key that is not DeepSpeed's is returned); the optimizer-states files give the
fp32 masters and Adam state (``flat_partitions.py``); a MoE model's experts are in per-expert
files, named globally (``expert_groups.py``). The trainable parameters' values in the
module state are the fp32 masters (ZeRO 3 saves empty tensors for them; bf16 saves rounded ones);
at ZeRO 3 a frozen parameter is saved empty too, each rank's model-states file holding its
partition of it (``frozen_param_fragments``), which are concatenated in rank order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointMismatchError, IncompleteCheckpointError
from ..expert_files import expert_file
from ..metadata import ZeroLayout
from .files import DeepSpeedFiles, find_files, model_file, zero3_model_file
from .flat_partitions import ParamState, reassemble
from .reassembled_reader import ReassembledReader, layout_of
from .restricted_load import LossScalerRecord, load_deepspeed_file

# The keys DeepSpeed writes into a model-states file itself; any other key is client state.
DEEPSPEED_KEYS = frozenset(
    "module buffer_names optimizer param_shapes frozen_param_shapes shared_params "
    "frozen_param_fragments lr_scheduler data_sampler random_ltd sparse_tensor_module_names "
    "skipped_steps global_steps global_samples dp_world_size mp_world_size ds_config ds_version "
    "checkpoint_parallel_dimensions universal_checkpoint_info iteration num_experts "
    "ds_autoep_layers".split()
)
_DYNAMIC_SCALER_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
_HYPER_PARAMETERS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


@dataclass
class DeepSpeedCheckpoint:
    """What one DeepSpeed checkpoint holds, in the shapes ``loader._apply`` takes."""

    directory: Path
    world_size: int
    stage: int
    module_state: dict  # every module state_dict entry, trainable parameters from the masters
    payload: dict  # counters, scheduler, scaler, param groups (loader's module-payload keys)
    client_state: dict
    params: list[ParamState]  # empty when the checkpoint has no optimizer states
    # What DeepSpeed recorded about the run: ds_config, ds_version, frozen_param_shapes.
    info: dict = field(default_factory=dict)

    def layout(self) -> ZeroLayout:
        return layout_of(self.params, self.stage, self.world_size)

    def reader(self) -> ReassembledReader:
        return ReassembledReader(self.params, self.layout())


def _loss_scaler(optim: dict | None):
    scaler = (optim or {}).get("optimizer_state_dict", {}).get("loss_scaler")
    if not isinstance(scaler, LossScalerRecord):
        return None
    values = {k: getattr(scaler, k) for k in _DYNAMIC_SCALER_KEYS if hasattr(scaler, k)}
    return values if len(values) == len(_DYNAMIC_SCALER_KEYS) else None


def _param_groups(optim: dict | None) -> list[dict]:
    inner = (optim or {}).get("optimizer_state_dict", {})
    base = inner.get("base_optimizer_state") or inner.get("optimizer_state_dict") or {}
    groups = []
    for group in base.get("param_groups", []):
        kept = {k: group[k] for k in _HYPER_PARAMETERS if k in group}
        if "betas" in kept:
            kept["betas"] = tuple(kept["betas"])
        groups.append(kept)
    return groups


def _frozen_fragments(directory: Path, world: int, allow_symlinks: bool, mp_rank: int):
    """ZeRO 3: each rank's model-states file holds its partition of every frozen parameter
    (``frozen_param_fragments``, in rank order); name -> the ranks' pieces."""
    pieces: dict[str, list] = {}
    for rank in range(world):
        path = directory / zero3_model_file(rank, mp_rank)
        if not path.is_file():
            raise IncompleteCheckpointError(
                f"DeepSpeed checkpoint {directory} is incomplete: {path.name} is missing (its "
                f"model states say {world} data-parallel ranks saved it; at ZeRO 3 each holds "
                "its part of the frozen parameters)"
            )
        fragments = load_deepspeed_file(path, allow_symlinks).get("frozen_param_fragments") or {}
        for name, piece in fragments.items():
            pieces.setdefault(name, []).append(piece.flatten())
    return pieces


def _expert_states(saved: dict, files: DeepSpeedFiles, symlinks) -> dict:
    """MoE models: every expert's tensors (global names) from DeepSpeed's per-expert files, all
    of which ``num_experts`` (one count per MoE layer) says must be there."""
    counts = saved.get("num_experts") or []
    wanted = [expert_file(layer, e) for layer, count in enumerate(counts) for e in range(count)]
    present = {path.name: path for path in files.experts}
    unexpected = sorted(set(present) - set(wanted))
    if unexpected:
        raise CheckpointMismatchError(
            f"DeepSpeed checkpoint {files.model.parent}: {unexpected[0]} is not one of the expert "
            f"files its model states announce (num_experts per MoE layer: {counts})"
        )
    state = {}
    for name in wanted:
        if name not in present:
            raise IncompleteCheckpointError(
                f"DeepSpeed checkpoint {files.model.parent} is incomplete: {name} is missing "
                f"(its model states say num_experts={counts} per MoE layer)"
            )
        state.update(load_deepspeed_file(present[name], symlinks))
    return state


def _module_state(saved: dict, params: list[ParamState], files: DeepSpeedFiles, world, symlinks,
                  mp_rank: int):  # fmt: skip
    path = files.model
    state = dict(saved["module"])
    state.update(_expert_states(saved, files, symlinks))
    for param in params:
        state[param.name] = param.master.view(param.shape)
    trainable = {p.name for p in params}
    empty = [
        name
        for name, value in state.items()
        if torch.is_tensor(value) and value.numel() == 0 and name not in trainable
    ]
    shapes = saved.get("frozen_param_shapes") or {}
    fragments = _frozen_fragments(path.parent, world, symlinks, mp_rank) if empty and shapes else {}
    for name in empty:
        if name not in shapes:
            raise CheckpointMismatchError(
                f"{path}: '{name}' is saved empty and is neither a trainable parameter in the "
                "optimizer-states files nor a frozen one ('frozen_param_shapes')"
            )
        shape = tuple(shapes[name])
        numel = math.prod(shape)
        if numel == 0:
            continue  # a parameter of no elements: empty is its value
        if name not in fragments or len(fragments[name]) != world:
            raise CheckpointMismatchError(
                f"{path}: '{name}' is saved empty (a ZeRO 3 frozen parameter) and the model-"
                f"states files of the {world} ranks do not all hold its part "
                "('frozen_param_fragments')"
            )
        whole = torch.cat(fragments[name])
        if whole.numel() < numel:
            raise IncompleteCheckpointError(
                f"{path}: frozen parameter '{name}' of shape {list(shape)} needs {numel} "
                f"elements, the ranks' parts hold {whole.numel()}"
            )
        state[name] = whole[:numel].view(shape).clone()
    return state


def read_deepspeed_checkpoint(directory: Path, allow_symlinks: bool, with_optimizer: bool):
    """The ``DeepSpeedCheckpoint`` in ``directory`` (one tag's folder). Only the restricted
    unpickler reads its files (``restricted_load.py``). A checkpoint of DeepSpeed's tensor
    parallelism (AutoTP, several ``mp_rank_XX`` files) is returned joined: every parameter
    whole, as at TP 1 (``tensor_parallel.py``)."""
    probe = directory / model_file(0)
    if not probe.is_file():
        probe = directory / zero3_model_file(0)
    model = load_deepspeed_file(probe, allow_symlinks)
    if "ds_version" not in model or not isinstance(model.get("module"), dict):
        raise IncompleteCheckpointError(
            f"checkpoint {directory} is incomplete: checkpoint_meta.json is missing, and "
            f"{probe.name} is not a DeepSpeed model-states file either"
        )
    mp_world = int(model.get("mp_world_size", 1))
    if mp_world == 1:
        return read_part(directory, model, 0, 1, allow_symlinks, with_optimizer)
    from .tensor_parallel import read_tensor_parallel  # it reads each part with read_part

    return read_tensor_parallel(directory, model, mp_world, allow_symlinks, with_optimizer)


def read_part(directory: Path, model: dict, mp_rank: int, mp_world: int, allow_symlinks: bool,
              with_optimizer: bool) -> DeepSpeedCheckpoint:  # fmt: skip
    """Model-parallel rank ``mp_rank``'s part of the checkpoint (its model states ``model``
    read already): that rank's slices and its optimizer partitions, as DeepSpeed saved them."""
    world = int(model.get("dp_world_size", 1))
    files = find_files(directory, world, mp_rank, mp_world)
    # ZeRO 3 keeps the trainable values only in the optimizer-states files: read them anyway.
    with_optimizer = with_optimizer or files.model.name == zero3_model_file(0, mp_rank)
    optims = [load_deepspeed_file(p, allow_symlinks) for p in files.optim] if with_optimizer else []
    params = reassemble(model, optims, list(files.optim), files.bf16) if optims else []
    if optims:
        stage = 3 if files.model.name.startswith("zero_pp_rank") else (1 if files.bf16 else None)
        if stage is None:
            stage = int(optims[0]["optimizer_state_dict"].get("zero_stage", 1))
    else:
        stage = 0
    global_steps = int(model.get("global_steps", 0))
    payload = {
        "global_steps": global_steps,
        "global_samples": int(model.get("global_samples", 0)),
        "skipped_steps": int(model.get("skipped_steps", 0)),
        "optimizer_skipped_steps": int(model.get("skipped_steps", 0)),
        "lr_scheduler": model.get("lr_scheduler"),
        "loss_scaler": _loss_scaler(optims[0] if optims else None),
        "param_groups": _param_groups(optims[0] if optims else None),
    }
    client_state = {k: v for k, v in model.items() if k not in DEEPSPEED_KEYS}
    module_state = _module_state(model, params, files, world, allow_symlinks, mp_rank)
    keys = ("ds_config", "ds_version", "frozen_param_shapes", "num_experts")
    info = {key: model.get(key) for key in keys}
    return DeepSpeedCheckpoint(
        directory, world, stage, module_state, payload, client_state, params, info
    )
