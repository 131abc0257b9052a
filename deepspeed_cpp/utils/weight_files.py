"""A ``state_dict`` written as the weight files Hugging Face ``from_pretrained`` reads.

In an output directory: ``pytorch_model.bin`` (torch) or ``model.safetensors``; past
``max_shard_size``, numbered shards (``pytorch_model-00001-of-00003.bin``,
``model-00001-of-00003.safetensors``) with an index (``pytorch_model.bin.index.json`` /
``model.safetensors.index.json``: ``{"metadata": {"total_size": N}, "weight_map": {name:
file}}``). These are the names DeepSpeed's ``zero_to_fp32.py`` and transformers write, split by
the same rule as ``huggingface_hub``'s ``split_torch_state_dict_into_shards`` (tensors in the
``state_dict``'s order, a new shard when the next tensor would pass the limit, a tensor larger
than the limit in a shard of its own; sizes in decimal units, ``"5GB"`` = 5e9 bytes), so that a
converted checkpoint is laid out exactly as one converted by DeepSpeed.

Every file is written atomically (temporary name, fsync, rename), the index last, so a reader
never sees an index naming a shard that is not whole.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.checkpoint.atomic_files import write_atomically_by_name, write_text_atomically

# huggingface_hub's units: decimal, as disk sizes are quoted.
SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
DEFAULT_MAX_SHARD_SIZE = "5GB"  # DeepSpeed's default (fits free-tier notebook memory)


def parse_size(size) -> int:
    """Bytes of ``"5GB"``, ``"500MB"``, ``"1.5KB"`` or a plain number of bytes; ValueError
    naming the text otherwise."""
    text = str(size).strip()
    unit = text[-2:].upper()
    number = text[:-2] if unit in SIZE_UNITS else text
    try:
        value = float(number) * SIZE_UNITS.get(unit, 1)
    except ValueError:
        value = -1.0
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(
            f"max_shard_size {size!r} is not a size: give a positive number of bytes or digits "
            f"followed by one of {', '.join(SIZE_UNITS)} (e.g. 5GB)"
        )
    return int(value)


def weights_name(safe_serialization: bool) -> str:
    return "model.safetensors" if safe_serialization else "pytorch_model.bin"


def index_name(safe_serialization: bool) -> str:
    return weights_name(safe_serialization) + ".index.json"


def shard_name(safe_serialization: bool, number: int, count: int) -> str:
    """``pytorch_model-00001-of-00002.bin``: the suffix goes before the extension."""
    stem, extension = os.path.splitext(weights_name(safe_serialization))
    return f"{stem}-{number:05d}-of-{count:05d}{extension}"


def _shard_pattern(safe_serialization: bool) -> re.Pattern:
    stem, extension = os.path.splitext(weights_name(safe_serialization))
    return re.compile(rf"{re.escape(stem)}-\d{{5}}-of-\d{{5}}{re.escape(extension)}")


@dataclass
class ShardPlan:
    files: dict[str, list[str]]  # file name -> tensor names, in the state_dict's order
    total_size: int  # bytes of tensor data, each stored tensor once

    @property
    def sharded(self) -> bool:
        return len(self.files) > 1


def _storage_key(tensor: torch.Tensor):
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def plan_shards(
    state_dict: dict[str, torch.Tensor], max_shard_size: int, safe_serialization: bool
) -> ShardPlan:
    """Which tensor goes into which file (the module docstring's rule).

    Names sharing one tensor (tied weights) go into the shard of the first of them, after its
    other names (as the hub orders them): torch.save then keeps them one tensor, counted once.
    safetensors stores each name's own copy (it refuses aliases), so there every name counts."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = total = 0
    first_of_storage: dict = {}
    followers: dict[str, list[str]] = {}
    for name, tensor in state_dict.items():
        if not safe_serialization:
            key = _storage_key(tensor)
            if key in first_of_storage:
                followers[first_of_storage[key]].append(name)
                continue
            first_of_storage[key] = name
            followers[name] = []
        size = tensor.numel() * tensor.element_size()
        total += size
        if size > max_shard_size:
            shards.append([name])
            continue
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(name)
        current_size += size
    if current or not shards:
        shards.append(current)
    shards = [shard + [f for name in shard for f in followers.get(name, ())] for shard in shards]
    if len(shards) == 1:
        return ShardPlan({weights_name(safe_serialization): shards[0]}, total)
    count = len(shards)
    files = {shard_name(safe_serialization, i + 1, count): s for i, s in enumerate(shards)}
    return ShardPlan(files, total)


def write_safetensors(state_dict: dict[str, torch.Tensor], path: Path) -> int:
    """``state_dict`` as one safetensors file at ``path``, atomically; returns its size."""
    from safetensors.torch import save_file

    # safetensors refuses aliases: a tied parameter is written once per name.
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        tensors[name] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
        seen.add(id(tensor))
    return write_atomically_by_name(
        path, lambda temporary: save_file(tensors, str(temporary), metadata={"format": "pt"})
    )


def write_torch(state_dict: dict[str, torch.Tensor], path: Path) -> int:
    """``state_dict`` as one ``torch.save`` file at ``path``, atomically; returns its size."""
    return write_atomically_by_name(path, lambda temporary: torch.save(state_dict, temporary))


def _remove_stale(directory: Path, safe_serialization: bool, written: set[str]) -> list[str]:
    """Files of this format that an earlier conversion into ``directory`` left and this one did
    not rewrite: from_pretrained reads the single file before an index, and an index before
    the shards it names, so a stale one would be loaded in place of the new weights."""
    pattern = _shard_pattern(safe_serialization)
    ours = {weights_name(safe_serialization), index_name(safe_serialization)}
    removed = []
    for entry in sorted(directory.iterdir()):
        if entry.name in written or not entry.is_file():
            continue
        if entry.name in ours or pattern.fullmatch(entry.name):
            entry.unlink()
            removed.append(entry.name)
    return removed


@dataclass
class WrittenWeights:
    files: dict[str, int]  # file name -> bytes, in the order written (the index last)
    removed: list[str]  # stale files of an earlier conversion (see _remove_stale)
    plan: ShardPlan


def write_weights_directory(
    state_dict: dict[str, torch.Tensor],
    directory,
    safe_serialization: bool = False,
    max_shard_size=DEFAULT_MAX_SHARD_SIZE,
) -> WrittenWeights:
    """Writes ``state_dict`` into ``directory`` (created if missing) as the module docstring
    describes; ``max_shard_size`` is bytes or a size text (``"5GB"``)."""
    limit = parse_size(max_shard_size)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plan = plan_shards(state_dict, limit, safe_serialization)
    write = write_safetensors if safe_serialization else write_torch
    # An earlier conversion's single file and index go first: a run stopped part-way must not
    # leave the old index naming a mix of new and old shards (loaders read through it); without
    # them a reader finds no weights and says so.
    cleared = []
    for entry_point in (weights_name(safe_serialization), index_name(safe_serialization)):
        if (directory / entry_point).is_file():
            (directory / entry_point).unlink()
            cleared.append(entry_point)
    sizes = {}
    for file_name, names in plan.files.items():
        sizes[file_name] = write({name: state_dict[name] for name in names}, directory / file_name)
    if plan.sharded:
        weight_map = {name: file_name for file_name, names in plan.files.items() for name in names}
        index = {"metadata": {"total_size": plan.total_size}, "weight_map": weight_map}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        file_name = index_name(safe_serialization)
        sizes[file_name] = write_text_atomically(directory / file_name, text)
    removed = [name for name in cleared if name not in sizes]
    removed += _remove_stale(directory, safe_serialization, set(sizes))
    return WrittenWeights(sizes, removed, plan)
