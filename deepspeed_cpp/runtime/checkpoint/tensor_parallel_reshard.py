"""Loading an AutoTP checkpoint at another tensor-parallel size (saved at TP S, loaded at TP T).

A checkpoint of a model split by AutoTP is S complete parts, one per TP rank
(``save_dir/mp_rank_XX``, see ``layout.py``; at TP 1 ``save_dir`` itself), each recording in its
metadata how its sliced parameters are split (``tensor_parallel_slices``: the split dimension
and the number of fused blocks it is made of). To load it at TP T, every rank

1. reads, per trainable parameter, its fp32 master and its element-wise optimizer state (Adam's
   ``exp_avg``, ``exp_avg_sq``) whole from every part, and joins a sliced parameter's parts along
   its split dimension (``unshard_tensors``); a replicated parameter, the same in every part, is
   taken from part 0 (as the module state's tensors are);
2. cuts this TP rank's slice of each parameter the engine holds sliced (``shard_tensor``, with the
   engine's own split of that parameter), and keeps a replicated one whole;
3. serves the result as a checkpoint in memory (``WholeParameterShards``: one bucket per
   parameter, held whole), so that the engine's own ZeRO plan (stage 0-2, any data-parallel size)
   gets its owned slices from the same ``Resharder`` as any other resharded load.

Adam-family updates are element-wise, so the re-cut state continues training exactly where the
saved one stopped. Per-bucket scalars (Adam's ``step``) are taken from the bucket of part 0
that held the parameter; parameters that the engine puts in one bucket must have the same
(``Resharder`` checks). RNG states are not restored (other ranks saved them).
Each rank holds the whole model's fp32 masters and state once in host memory while it loads.

Refused by name: parts that do not record their slices (a caller's own mpu, not AutoTP), a
split dimension that differs between the checkpoint and the engine, shapes that do not join or
divide, parts saved at different tags, and optimizer state that is neither element-wise nor a
scalar.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ...module_inject import tensor_parallel_info, tensor_parallel_slices
from ...module_inject.layers import shard_tensor, unshard_tensors
from .deepspeed_format.convert import CONVERTED_FROM_KEY
from .deepspeed_format.tensor_parallel import SIZE_KEY, SPLITS_KEY, check_splits_agree
from .digests import file_digests
from .errors import CheckpointMismatchError, ModelParallelMismatchError
from .layout import (
    LATEST_FILE,
    MODULE_FILE,
    check_model_parallel_metadata,
    listed_file,
    model_parallel_folder,
    read_latest_tag,
    tag_directory,
)
from .layout import read_metadata as read_checked_metadata
from .metadata import BucketRecord, ParamRecord, ShardSlice, ZeroLayout
from .reshard import ELEMENTWISE, SCALAR
from .shard_reader import MASTER, ShardReader, load_mapped

SLICES_KEY = "tensor_parallel_slices"


def _saved_parts(load_dir: Path) -> list[str]:
    return sorted(p.name for p in load_dir.glob("mp_rank_[0-9][0-9]") if p.is_dir())


def saved_size_to_reshard(subject, load_dir) -> int | None:
    """The TP size ``load_dir`` was saved at when the engine must re-cut it (an AutoTP engine,
    or one without model parallelism, at another size); None when it loads as saved."""
    info = tensor_parallel_info(subject.module)
    if info is None and subject.mp_world_size > 1:
        return None  # a caller's own mpu: its parts are not resharded (layout.py refuses)
    current = subject.mp_world_size
    base = Path(load_dir)
    parts = _saved_parts(base)
    if parts and not (base / LATEST_FILE).exists():
        saved = len(parts)
    elif not parts and (base / LATEST_FILE).exists():
        saved = 1
    else:
        return None  # nothing there, or an ambiguous folder: the ordinary path reports it
    return saved if saved != current else None


def part_directories(load_dir, saved_size: int, tag, allow_symlinks: bool) -> list[Path] | None:
    """The tag folder of every saved part, in TP rank order; None when ``tag`` is None and
    there is no ``latest`` (nothing to load). Refuses parts whose ``latest`` differ."""
    base = Path(load_dir)
    homes = (
        [base] if saved_size == 1 else [base / model_parallel_folder(m) for m in range(saved_size)]
    )
    if tag is None:
        tags = [read_latest_tag(home, allow_symlinks) for home in homes]
        if tags[0] is None:
            return None
        if any(t != tags[0] for t in tags):
            raise ModelParallelMismatchError(
                f"the tensor-parallel parts of {base} name different latest checkpoints "
                f"({dict(zip((h.name for h in homes), tags))}); pass tag=... to pick one"
            )
        tag = tags[0]
    return [tag_directory(home, tag, allow_symlinks) for home in homes]


class WholeParameterShards:
    """A ``ShardReader`` over values in memory: parameter ``i`` of ``layout`` is bucket ``i``,
    held whole by one slice; ``values[i]`` maps ``"master"`` and each optimizer-state key to its
    flat tensor (or a scalar)."""

    def __init__(self, layout: ZeroLayout, values: list[dict]):
        self.layout = layout
        self._values = values

    def entry(self, piece: ShardSlice, bucket: int) -> dict:
        values = self._values[bucket]
        state = {k: v for k, v in values.items() if k != MASTER}
        return {
            "start": 0,
            "size": values[MASTER].numel(),
            "master": values[MASTER],
            "state": state,
        }

    def dtype(self, key: str, bucket: int) -> torch.dtype:
        return self._values[bucket][key].dtype

    def scalar(self, key: str, bucket: int):
        return self._values[bucket][key]

    def read(self, key: str, bucket: int, start: int, stop: int, out: torch.Tensor | None) -> None:
        source = self._values[bucket][key]
        if not 0 <= start <= stop <= source.numel():
            raise CheckpointMismatchError(
                f"elements [{start}, {stop}) of '{self.layout.params[bucket].name}' asked for; "
                f"it has {source.numel()}"
            )
        if out is not None:
            out.copy_(source[start:stop])

    def release_pages(self) -> None:
        pass

    def close(self) -> None:
        self._values = []


@dataclass
class _Part:
    directory: Path
    metadata: dict
    digests: dict
    payload: dict
    layout: ZeroLayout | None
    slices: dict[str, list[int]]


def read_parts(directories: list[Path], allow_symlinks: bool) -> list[_Part]:
    """Every saved part's checked metadata, module-states payload and layout."""
    parts = []
    size = len(directories)
    for mp_rank, directory in enumerate(directories):
        metadata = read_checked_metadata(directory, allow_symlinks)
        if metadata.get("pipeline") is not None:
            raise CheckpointMismatchError(
                f"{directory} is a pipeline checkpoint; it cannot be loaded at another "
                "tensor-parallel size"
            )
        check_model_parallel_metadata(metadata, mp_rank, size, directory)
        if size > 1 and SLICES_KEY not in metadata:
            raise ModelParallelMismatchError(
                f"{directory} is a model-parallel part without {SLICES_KEY} in its metadata "
                f"(saved with a caller's own mpu, not AutoTP): it loads only at model-parallel "
                f"size {size}"
            )
        digests = file_digests(metadata)
        module_file = listed_file(directory, MODULE_FILE, digests, "module states")
        payload = load_mapped(module_file, digests.get(MODULE_FILE), "module states")
        layout = metadata["zero_layout"]
        parts.append(
            _Part(
                directory,
                metadata,
                digests,
                payload,
                ZeroLayout.from_json(layout) if layout is not None else None,
                metadata.get(SLICES_KEY, {}),
            )
        )
    return parts


class Recut:
    """Joins the saved parts of one tensor and cuts this TP rank's slice of it."""

    def __init__(self, parts: list[_Part], module: torch.nn.Module, tp_rank: int, tp_size: int):
        self.saved_slices = parts[0].slices
        self.current_slices = tensor_parallel_slices(module) if tp_size > 1 else {}
        self.tp_rank, self.tp_size = tp_rank, tp_size
        converted = parts[0].metadata.get(CONVERTED_FROM_KEY) or {}
        if tp_size > 1 and converted.get(SIZE_KEY, 1) > 1:  # DeepSpeed's AutoTP, joined
            check_splits_agree(
                converted[SPLITS_KEY], self.current_slices, converted[SIZE_KEY],
                type(module).__name__,
            )  # fmt: skip
        for name, split in self.current_slices.items():
            saved = self.saved_slices.get(name)
            if saved is not None and list(saved) != list(split):
                raise CheckpointMismatchError(
                    f"'{name}' is split along dimension {saved[0]} in {saved[1]} block(s) in the "
                    f"checkpoint and along dimension {split[0]} in {split[1]} block(s) here"
                )

    def splits(self, name: str) -> bool:
        """Whether ``name`` is sliced in the checkpoint or here."""
        return name in self.saved_slices or name in self.current_slices

    def __call__(self, name: str, pieces: list[torch.Tensor], expected_shape) -> torch.Tensor:
        """``pieces`` (one per saved part, shaped) joined and re-cut; CheckpointMismatchError
        unless the result has ``expected_shape``."""
        try:
            whole = pieces[0]
            if name in self.saved_slices:
                dim, blocks = self.saved_slices[name]
                whole = unshard_tensors(pieces, dim, blocks)
            mine = whole
            if name in self.current_slices:
                dim, blocks = self.current_slices[name]
                mine = shard_tensor(whole, dim, self.tp_rank, self.tp_size, blocks)
        except (ValueError, RuntimeError) as error:
            raise CheckpointMismatchError(
                f"'{name}' (saved as {[list(p.shape) for p in pieces]}) cannot be re-cut for "
                f"tensor-parallel rank {self.tp_rank} of {self.tp_size}: {error}"
            ) from None
        if tuple(mine.shape) != tuple(expected_shape):
            raise CheckpointMismatchError(
                f"'{name}': the checkpoint's tensor-parallel parts "
                f"{[list(p.shape) for p in pieces]} give shape {list(mine.shape)} at "
                f"tensor-parallel rank {self.tp_rank} of {self.tp_size}; the model holds "
                f"{list(expected_shape)}"
            )
        return mine.contiguous()


def module_state(parts: list[_Part], module: torch.nn.Module, recut: Recut) -> dict:
    """The module state for this TP rank: part 0's names, sliced tensors joined and re-cut."""
    current = dict(module.state_dict(keep_vars=True))
    state = {}
    for name, value in parts[0].payload["module"].items():
        # A ZeRO-3 partitioned parameter's tensor is empty; ds_shape is its shape.
        expected = (
            getattr(current[name], "ds_shape", current[name].shape) if name in current else None
        )
        if recut.splits(name):
            pieces = [part.payload["module"][name] for part in parts]
            value = recut(name, pieces, expected if expected is not None else ())
        state[name] = value
    return state


def _read_whole(reader: ShardReader, record: ParamRecord, key: str) -> torch.Tensor:
    out = torch.empty(record.numel, dtype=reader.dtype(key, record.bucket))
    reader.read(key, record.bucket, record.offset, record.offset + record.numel, out)
    return out.view(record.shape)


def whole_parameter_shards(
    parts: list[_Part], target: ZeroLayout, recut: Recut, state_kinds: dict[str, str]
) -> WholeParameterShards:
    """This rank's re-cut masters and optimizer state (``state_kinds``), one bucket per
    parameter of ``target`` (the engine's layout)."""
    for part in parts:
        if part.layout is None:
            raise CheckpointMismatchError(
                f"{part.directory} was saved by an engine without an optimizer (no fp32 "
                "masters); pass load_module_only=True"
            )
    for key, kind in state_kinds.items():
        if kind not in (ELEMENTWISE, SCALAR):
            raise CheckpointMismatchError(
                f"optimizer state '{key}' is neither element-wise nor a scalar: it cannot be "
                "re-cut for another tensor-parallel size; pass load_optimizer_states=False"
            )
    readers = [ShardReader(part.directory, part.layout, part.digests) for part in parts]
    by_name = [part.layout.by_name() for part in parts]
    params, buckets, values = [], [], []
    try:
        for index, record in enumerate(target.params):
            saved = []
            for part, names in zip(parts, by_name):
                found = next((names[n] for n in record.names if n in names), None)
                if found is None:
                    raise CheckpointMismatchError(
                        f"parameter '{record.name}' (shape {list(record.shape)}) is trained by "
                        f"this engine but {part.directory} has no fp32 master for it"
                    )
                if found.group != record.group:
                    raise CheckpointMismatchError(
                        f"parameter '{record.name}' is in optimizer param group {record.group} "
                        f"here and in group {found.group} in the checkpoint"
                    )
                saved.append(found)
            name = next((n for n in record.names if recut.splits(n)), record.name)
            entry = {}
            for key in (MASTER, *(k for k, kind in state_kinds.items() if kind == ELEMENTWISE)):
                pieces = [_read_whole(r, s, key) for r, s in zip(readers, saved)]
                entry[key] = recut(name, pieces, record.shape).flatten()
            for key in (k for k, kind in state_kinds.items() if kind == SCALAR):
                value = readers[0].scalar(key, saved[0].bucket)
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            params.append(
                ParamRecord(record.names, record.shape, record.dtype, record.group, index, 0)
            )
            buckets.append(
                BucketRecord(
                    record.numel, record.group, (ShardSlice(0, "memory", 0, record.numel),)
                )
            )
            values.append(entry)
    finally:
        for reader in readers:
            reader.close()
    layout = ZeroLayout(target.stage, 1, tuple(params), tuple(buckets))
    return WholeParameterShards(layout, values)
