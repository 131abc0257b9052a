"""DeepSpeed's tensor-parallel (AutoTP training) checkpoints: the ``mp_rank_XX`` parts joined
into whole parameters, and cut again for a deepspeed_cpp engine.

With ``tensor_parallel.autotp_size`` N, DeepSpeed writes every file once per TP rank
(``mp_rank_00`` .. ``mp_rank_{N-1}``), each holding that rank's slices: its module state, its
``param_shapes`` (the slices' shapes) and its optimizer partitions (each TP rank's ZeRO
partitions its own slices over the data-parallel ranks). Which dimension each parameter was cut
along is recorded in the model states' ``universal_checkpoint_info["affine_map"]``: per parameter
its whole (``logical_shape``) and each rank's ``shard_shape`` and source offset. A parameter whose
shard is its whole shape is replicated (embeddings, norms, a row-parallel layer's bias); any
other is cut along the one dimension where the two differ, rank r holding the r-th contiguous
piece (the only layout DeepSpeed's AutoTP training writes for these policies; any other, e.g.
several pieces per rank, is refused naming the parameter).

``read_tensor_parallel`` joins the parts (fp32 masters, Adam's element-wise moments, module
tensors; scalars and replicated tensors from part 0) into one ``DeepSpeedCheckpoint`` as at TP 1,
recording the split dimensions in ``info["tensor_parallel_splits"]``. ``fit_to_engine`` then
compares them with the engine's own split (``tensor_parallel_slices`` of a split model, or, for an
unsplit engine, ``planned_slices``: what deepspeed_cpp's policy would split at DeepSpeed's size)
and refuses any parameter the two split differently, naming it; at the saved TP size it cuts this
rank's slices back out (``shard_tensor``), at TP 1 it keeps them whole. Adam's update is element
by element, so the re-cut state continues training exactly as DeepSpeed's own resume does.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path

import torch

from ....module_inject import planned_slices, tensor_parallel_info, tensor_parallel_slices
from ....module_inject.layers import shard_tensor, unshard_tensors
from ..errors import CheckpointMismatchError, IncompleteCheckpointError, ModelParallelMismatchError
from .checkpoint import DeepSpeedCheckpoint, read_part
from .files import model_file, optim_file
from .flat_partitions import ParamState
from .restricted_load import load_deepspeed_file

SPLITS_KEY = "tensor_parallel_splits"  # info: {name: split dimension} of the sliced parameters
SIZE_KEY = "tensor_parallel_size"


def _split_dimension(name: str, entry: dict, size: int, where: Path) -> int | None:
    """The dimension ``name`` is cut along (None: replicated), from its affine-map ``entry``."""
    logical = [int(d) for d in entry["logical_shape"]]
    ranks = entry["ranks"]
    shards = [[int(d) for d in ranks[r]["shard_shape"]] for r in range(size)]
    if all(shard == logical for shard in shards):
        return None
    differing = [d for d in range(len(logical)) if shards[0][d] != logical[d]]
    contiguous = len(differing) == 1 and all(shard == shards[0] for shard in shards)
    if contiguous:
        dim = differing[0]
        stride = math.prod(logical[dim + 1 :])
        contiguous = shards[0][dim] * size == logical[dim] and all(
            len(ranks[r]["pieces"]) == 1
            and int(ranks[r]["pieces"][0]["source"][0]) == r * shards[0][dim] * stride
            for r in range(size)
        )
    if not contiguous:
        raise CheckpointMismatchError(
            f"{where}: DeepSpeed split '{name}' (shape {logical}) into the pieces "
            f"{[ranks[r]['pieces'] for r in range(size)]}; deepspeed_cpp joins parameters cut "
            "into one contiguous piece per tensor-parallel rank along one dimension"
        )
    return differing[0]


def deepspeed_splits(model: dict, shapes: dict, size: int, where: Path) -> dict[str, int]:
    """{parameter name: split dimension} of every sliced tensor of the module state; ``shapes``:
    {name: [each part's shape]}. A tensor the affine map does not list (a buffer) must be
    replicated: the same shape in every part."""
    info = model.get("universal_checkpoint_info")
    affine = info.get("affine_map") if isinstance(info, dict) else None
    if not isinstance(affine, dict) or not isinstance(affine.get("params"), dict):
        raise IncompleteCheckpointError(
            f"{where}: the model states of this tensor-parallel DeepSpeed checkpoint (mp_world_"
            f"size {size}) have no universal_checkpoint_info['affine_map'], which says how each "
            "parameter was split"
        )
    splits = {}
    for name, part_shapes in shapes.items():
        entries = [e for p, e in affine["params"].items() if re.fullmatch(p, name)]
        if not entries and all(shape == part_shapes[0] for shape in part_shapes):
            continue  # not a parameter DeepSpeed split: a buffer, whole in every part
        if len(entries) != 1:
            raise IncompleteCheckpointError(
                f"{where}: universal_checkpoint_info['affine_map'] has {len(entries)} entries "
                f"for '{name}'; expected one (how DeepSpeed split it)"
            )
        dim = _split_dimension(name, entries[0], size, where)
        if dim is not None:
            splits[name] = dim
    return splits


def _join_param(params: list[ParamState], dim: int | None) -> ParamState:
    first = params[0]
    if dim is None:
        return first
    shaped = [p.master.view(p.shape) for p in params]
    master = unshard_tensors(shaped, dim)
    state = dict(first.state)
    for key, value in first.state.items():
        if torch.is_tensor(value) and value.dim() > 0:  # element-wise, flat like the master
            pieces = [p.state[key].view(p.shape) for p in params]
            state[key] = unshard_tensors(pieces, dim).flatten()
    return ParamState(first.name, tuple(master.shape), first.group, master.flatten(), state)


def read_tensor_parallel(
    directory: Path, model: dict, size: int, allow_symlinks: bool, with_optimizer: bool
) -> DeepSpeedCheckpoint:
    """The ``size`` parts of the checkpoint in ``directory`` joined (see the module docstring);
    ``model``: part 0's model states."""
    models = [model]
    for mp_rank in range(1, size):
        path = directory / model_file(mp_rank)
        if not path.is_file():
            raise IncompleteCheckpointError(
                f"DeepSpeed checkpoint {directory} is incomplete: {path.name} is missing (its "
                f"model states say {size} tensor-parallel ranks saved it)"
            )
        models.append(load_deepspeed_file(path, allow_symlinks))
    parts = [
        read_part(directory, m, r, size, allow_symlinks, with_optimizer)
        for r, m in enumerate(models)
    ]
    first = parts[0]
    for mp_rank, part in enumerate(parts):
        if bool(part.params) != bool(first.params):
            lacking = mp_rank if first.params else 0
            bf16 = any((directory / optim_file(0, True, r)).is_file() for r in range(size))
            raise IncompleteCheckpointError(
                f"DeepSpeed checkpoint {directory} is incomplete: "
                f"{optim_file(0, bf16, lacking)} is missing (the other tensor-parallel ranks "
                "saved their optimizer states)"
            )
    if first.stage == 3:
        raise CheckpointMismatchError(
            f"{directory}: a ZeRO-3 checkpoint with {size} tensor-parallel ranks; DeepSpeed's "
            "AutoTP training runs at ZeRO 0-2, and deepspeed_cpp joins those only"
        )
    shapes = {
        name: [tuple(getattr(p.module_state.get(name), "shape", ())) for p in parts]
        for name in first.module_state
    }
    splits = deepspeed_splits(model, shapes, size, directory)
    module_state = dict(first.module_state)
    for name, dim in splits.items():
        module_state[name] = unshard_tensors([p.module_state[name] for p in parts], dim)
    params = []
    for index, param in enumerate(first.params):
        group = [p.params[index] if index < len(p.params) else None for p in parts]
        if any(g is None or g.name != param.name for g in group):
            raise CheckpointMismatchError(
                f"{directory}: the tensor-parallel parts do not hold the same parameters in the "
                f"same order (part 0's parameter {index} is '{param.name}')"
            )
        params.append(_join_param(group, splits.get(param.name)))
        module_state[param.name] = params[-1].master.view(params[-1].shape)
    info = {**first.info, SPLITS_KEY: splits, SIZE_KEY: size}
    return replace(first, module_state=module_state, params=params, info=info)


def check_splits_agree(theirs: dict, ours: dict, size: int, model_name: str) -> None:
    """CheckpointMismatchError naming the first parameter that DeepSpeed split (``theirs``:
    {name: dim}, at TP ``size``) otherwise than deepspeed_cpp's policy (``ours``: {name: [dim,
    blocks]}): its slices would land on other weights."""
    for name in sorted(set(ours) | set(theirs)):
        mine = ours.get(name)
        if name not in theirs or mine is None or list(mine) != [theirs[name], 1]:
            said = f"along dimension {theirs[name]}" if name in theirs else "not (replicated)"
            here = (
                f"along dimension {mine[0]} in {mine[1]} block(s)" if mine else "not (replicated)"
            )
            raise CheckpointMismatchError(
                f"'{name}': DeepSpeed's AutoTP split it {said} at tensor-parallel size {size}; "
                f"deepspeed_cpp's policy for {model_name} splits it {here}: the checkpoint's "
                "slices would land on other weights"
            )


def fit_to_engine(saved: DeepSpeedCheckpoint, module, tp_rank: int, tp_size: int):
    """``saved`` (joined) as the engine holds it: compared with the engine's split and, at TP
    ``tp_size`` > 1, cut to this rank's slices (see the module docstring)."""
    size = saved.info.get(SIZE_KEY, 1)
    tp = tensor_parallel_info(module)
    if size == 1:
        if tp_size > 1:
            raise ModelParallelMismatchError(
                f"{saved.directory} is a DeepSpeed checkpoint without tensor parallelism; this "
                f"engine runs at model-parallel size {tp_size}: load it at size 1, or convert it "
                "(python -m deepspeed_cpp.checkpoint.convert) and load the converted folder"
            )
        return saved
    if tp_size not in (1, size):
        raise ModelParallelMismatchError(
            f"{saved.directory} was saved by DeepSpeed at tensor-parallel size {size}; this "
            f"engine runs at tensor-parallel size {tp_size}: DeepSpeed's AutoTP checkpoints load "
            f"at their own size ({size}) or joined at size 1"
        )
    if tp_size > 1 and tp is None:
        raise ModelParallelMismatchError(
            f"{saved.directory} is a DeepSpeed AutoTP checkpoint (tensor-parallel size {size}); "
            f"this engine's model parallelism (size {tp_size}) is a caller's own mpu, not AutoTP"
        )
    ours = tensor_parallel_slices(module) if tp_size > 1 else planned_slices(module, size)
    theirs = saved.info[SPLITS_KEY]
    check_splits_agree(theirs, ours, size, type(module).__name__)
    if tp_size == 1:
        return saved
    try:
        module_state = dict(saved.module_state)
        for name, dim in theirs.items():
            module_state[name] = shard_tensor(module_state[name], dim, tp_rank, tp_size)
        params = []
        for param in saved.params:
            dim = theirs.get(param.name)
            if dim is None:
                params.append(param)
                continue
            master = shard_tensor(param.master.view(param.shape), dim, tp_rank, tp_size)
            state = {
                key: shard_tensor(v.view(param.shape), dim, tp_rank, tp_size).flatten()
                if torch.is_tensor(v) and v.dim() > 0
                else v
                for key, v in param.state.items()
            }
            params.append(
                ParamState(param.name, tuple(master.shape), param.group, master.flatten(), state)
            )
            module_state[param.name] = master
    except ValueError as error:
        raise CheckpointMismatchError(f"{saved.directory}: {error}") from None
    return replace(saved, module_state=module_state, params=params)
