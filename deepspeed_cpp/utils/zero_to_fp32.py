"""Consolidates a deepspeed_cpp ZeRO checkpoint (stages 0-3, any world size) into one fp32
``state_dict``, with no engine and no process group.

```
python -m deepspeed_cpp.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT \\
    [--safe_serialization] [--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters] \\
    [-d] [--allow_symlinks]
```

(``save_checkpoint`` also writes ``zero_to_fp32.py`` beside ``latest``, which runs this: ``cd
checkpoint-12; python zero_to_fp32.py . OUTPUT``.) ``CHECKPOINT_DIR`` is the directory given to
``save_checkpoint`` (the tag is read from its ``latest`` file unless ``--tag`` is given) or a tag
directory itself. ``OUTPUT`` takes two forms, told apart by ``output_is_directory``:

- an output directory (DeepSpeed 0.19's arguments): an existing directory, a path ending in
  ``/``, or a new path without a weight-file suffix. It receives ``pytorch_model.bin`` (or
  ``model.safetensors`` with ``--safe_serialization``), or past ``--max_shard_size`` (default
  5GB) numbered shards and an index json, with DeepSpeed's and transformers' file names
  (``weight_files.py``);
- one output file: a new path ending in ``.bin``, ``.pt``, ``.pth``, ``.safetensors`` or
  ``.ckpt``, or an existing file; it holds the whole ``state_dict`` (torch, or safetensors with
  ``--safe_serialization``), as the guide's ``python zero_to_fp32.py . pytorch_model.bin`` asks.

A checkpoint of a model split by AutoTP (``tensor_parallel.autotp_size``: one ``mp_rank_XX``
folder per TP rank) is consolidated part by part and its slices concatenated into the unsplit
parameters (the ``tensor_parallel_slices`` of the metadata), so that a model without tensor
parallelism loads it.

What it holds, in the order of the model's own ``state_dict`` (the experts of MoE layers last,
every expert of every rank under its global name, see ``deepspeed_cpp.moe.expert_names``):
every trainable parameter as its fp32 master value (not the fp16/bf16 copy the model trains
with), frozen parameters (converted to fp32) and buffers (as saved) from the module-states
file. A tied parameter appears under every name that shares it (one shared tensor in a torch
file; a copy per name in safetensors, which cannot store aliases).

A pipeline checkpoint (``PipelineEngine.save_checkpoint``) gives the ``PipelineModule``'s names
with each stage's fp32 masters (``pipeline_to_fp32.py``).

Integrity: the metadata's digest and each file's SHA-256 are checked as the files are read (a
damaged file raises ``IncompleteCheckpointError`` naming it and both digests); a file holding
objects other than tensors, a symbolic link (without ``--allow_symlinks``) or a tag that leads
out of ``CHECKPOINT_DIR`` raises ``UnsafeCheckpointError``. The command prints such an error as
one line and exits 1.

Memory: the shard files are read one at a time, memory-mapped, and each fp32 value is copied
straight into its place in the output, so the peak stays near the size of the output (plus the
master slices of one shard file while it is read), not the size of the checkpoint.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from pathlib import Path

import torch

from ..module_inject.auto_tp import merge_tensor_parallel_parts
from ..runtime.checkpoint.digests import file_digests
from ..runtime.checkpoint.errors import CheckpointMismatchError, IncompleteCheckpointError
from ..runtime.checkpoint.expert_files import read_expert_states
from ..runtime.checkpoint.layout import (
    LATEST_FILE,
    METADATA_FILE,
    MODULE_FILE,
    listed_file,
    read_metadata,
    resolve_checkpoint_dir,
)
from ..runtime.checkpoint.metadata import ZeroLayout
from ..runtime.checkpoint.shard_reader import load_mapped
from .pipeline_to_fp32 import pipeline_fp32_state_dict
from .weight_files import (
    DEFAULT_MAX_SHARD_SIZE,
    ShardPlan,
    WrittenWeights,
    parse_size,
    write_safetensors,
    write_torch,
    write_weights_directory,
)


def _trainable_fp32(
    directory: Path, layout: ZeroLayout, digests: dict[str, str | None]
) -> dict[str, torch.Tensor]:
    """Every trainable parameter's fp32 master value, by primary name, one shard at a time
    (each checked against its SHA-256 before it is read)."""
    values = {p.name: torch.empty(p.numel, dtype=torch.float32) for p in layout.params}
    filled = dict.fromkeys(values, 0)
    for file_name in layout.files():
        path = listed_file(directory, file_name, digests, "shard file")
        shard = load_mapped(path, digests.get(file_name), "shard file")
        for bucket_index, bucket in enumerate(layout.buckets):
            for piece in (s for s in bucket.slices if s.file == file_name):
                entry = shard["buckets"].get(bucket_index)
                if entry is None or (entry["start"], entry["size"]) != (piece.start, piece.size):
                    raise IncompleteCheckpointError(
                        f"{directory / file_name} does not hold elements [{piece.start}, "
                        f"{piece.start + piece.size}) of bucket {bucket_index} as "
                        f"checkpoint_meta.json says"
                    )
                master = entry["master"]
                for part in layout.pieces(bucket_index, piece.start, piece.start + piece.size):
                    low = part.bucket_start - piece.start
                    count = part.param_stop - part.param_start
                    target = values[part.param.name]
                    target[part.param_start : part.param_stop].copy_(master[low : low + count])
                    filled[part.param.name] += count
        del shard  # unmaps the file before the next one is opened
    for record in layout.params:
        if filled[record.name] != record.numel:
            raise IncompleteCheckpointError(
                f"parameter '{record.name}': the shard files of {directory} hold "
                f"{filled[record.name]} of its {record.numel} elements"
            )
    return {p.name: values[p.name].view(p.shape) for p in layout.params}


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir,
    tag: str | None = None,
    exclude_frozen_parameters: bool = False,
    allow_symlinks: bool = False,
) -> dict[str, torch.Tensor]:
    """The consolidated fp32 ``state_dict`` of a checkpoint, on the CPU (see the module doc).

    ``checkpoint_dir``: the directory given to ``save_checkpoint`` (then ``tag`` or its
    ``latest`` file picks the checkpoint) or a tag directory. The tag must be one directory
    name in it; symbolic links are followed only with ``allow_symlinks`` (as when loading).
    """
    parts = _model_parallel_parts(checkpoint_dir)
    if parts:
        return _merged_tensor_parallel_parts(parts, tag, exclude_frozen_parameters, allow_symlinks)
    directory = resolve_checkpoint_dir(checkpoint_dir, tag, allow_symlinks)
    metadata = read_metadata(directory, allow_symlinks)
    digests = file_digests(metadata)
    if metadata.get("pipeline") is not None:
        return pipeline_fp32_state_dict(directory, metadata, digests)
    module_file = listed_file(directory, MODULE_FILE, digests, "module states")
    module_state = load_mapped(module_file, digests.get(MODULE_FILE), "module states")
    # Experts of MoE layers have files of their own, under global names (expert_files.py).
    module_state = {**module_state["module"], **read_expert_states(directory, metadata, digests)}
    layout = ZeroLayout.from_json(metadata["zero_layout"]) if metadata["zero_layout"] else None
    trainable = _trainable_fp32(directory, layout, digests) if layout is not None else {}
    primary = {name: p.name for p in (layout.params if layout else ()) for name in p.names}
    frozen = {name for p in metadata["frozen_parameters"] for name in p["names"]}
    state_dict: dict[str, torch.Tensor] = {}
    for name, saved in module_state.items():
        if name in primary:
            state_dict[name] = trainable[primary[name]]
        elif name in frozen:
            if not exclude_frozen_parameters:
                value = saved.to(torch.float32) if saved.is_floating_point() else saved
                state_dict[name] = value.clone() if value is saved else value  # off the map
        else:
            state_dict[name] = saved.clone()  # a buffer, as saved
    for name, owner in primary.items():  # parameters the optimizer trains outside the module
        state_dict.setdefault(name, trainable[owner])
    return state_dict


def _model_parallel_parts(checkpoint_dir) -> list[Path]:
    """The ``mp_rank_XX`` folders of a checkpoint saved with model parallelism (one per
    model-parallel rank, ``runtime/checkpoint/layout.py``), in rank order; [] otherwise."""
    base = Path(checkpoint_dir)
    if (base / LATEST_FILE).exists() or (base / METADATA_FILE).exists():
        return []
    return sorted(p for p in base.glob("mp_rank_[0-9][0-9]") if p.is_dir())


def _merged_tensor_parallel_parts(parts, tag, exclude_frozen_parameters, allow_symlinks) -> dict:
    """The unsplit fp32 state dict of an AutoTP checkpoint: each TP rank's part consolidated,
    then its slices concatenated as the metadata's ``tensor_parallel_slices`` say."""
    states, slices = [], None
    for part in parts:
        states.append(
            get_fp32_state_dict_from_zero_checkpoint(
                part, tag, exclude_frozen_parameters, allow_symlinks
            )
        )
        metadata = read_metadata(resolve_checkpoint_dir(part, tag, allow_symlinks), allow_symlinks)
        if "tensor_parallel_slices" not in metadata:
            raise CheckpointMismatchError(
                f"{part}: a model-parallel part without tensor_parallel_slices in its metadata "
                "(saved with a caller's own mpu, not AutoTP): its parts cannot be merged into "
                "one model here; consolidate each mp_rank_XX folder on its own"
            )
        slices = metadata["tensor_parallel_slices"]
    return merge_tensor_parallel_parts(states, slices)


def load_state_dict_from_zero_checkpoint(
    model: torch.nn.Module, checkpoint_dir, tag=None, allow_symlinks: bool = False
):
    """Loads the consolidated fp32 weights into ``model`` (moved to the CPU first, as DeepSpeed
    does, since the weights may not fit next to the training state) and returns it.

    Parameters are copied into the model's own tensors, so a bf16/fp16 model rounds them.
    A checkpoint of another model is refused naming the first differing name and shapes.
    """
    from ..runtime.checkpoint.loader import check_module_matches

    state_dict = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, allow_symlinks=allow_symlinks
    )
    directory = resolve_checkpoint_dir(checkpoint_dir, tag, allow_symlinks)
    metadata = read_metadata(directory, allow_symlinks)
    allow_missing = ()
    if metadata.get("frozen_parameters_excluded"):
        allow_missing = {n for p in metadata["frozen_parameters"] for n in p["names"]}
    model = model.cpu()
    check_module_matches(model, state_dict, strict=True, allow_missing=allow_missing)
    model.load_state_dict(state_dict, strict=False)
    return model


# A path that does not exist yet names a file when it ends in one of these (the file form kept
# from before DeepSpeed 0.19 and in the guide: `zero_to_fp32.py . pytorch_model.bin`).
FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors", ".ckpt")


def output_is_directory(output) -> bool:
    """Which form ``output`` asks for: an existing directory, a path ending in a separator, or
    a new path without a weight-file suffix (``FILE_SUFFIXES``) is an output directory
    (DeepSpeed 0.19's form); an existing file or a new ``*.bin``/``*.safetensors``... path is
    the one output file."""
    text = os.fspath(output)
    if os.path.isdir(text):
        return True
    if os.path.lexists(text):
        return False
    if text.endswith(("/", os.sep)):
        return True
    return Path(text).suffix.lower() not in FILE_SUFFIXES


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output,
    tag: str | None = None,
    safe_serialization: bool = False,
    allow_symlinks: bool = False,
    *,
    max_shard_size=None,
    exclude_frozen_parameters: bool = False,
) -> WrittenWeights:
    """Writes the consolidated fp32 ``state_dict`` to ``output``, atomically, file by file.

    ``output`` is an output directory or one file, as ``output_is_directory`` decides. Into a
    directory go DeepSpeed 0.19's files (``weight_files.py``: ``pytorch_model.bin`` or
    ``model.safetensors``, sharded with an index past ``max_shard_size``, default ``"5GB"``);
    a file gets the whole ``state_dict`` and ``max_shard_size`` is refused. DeepSpeed's own
    signature puts ``max_shard_size`` third; here it is a keyword, after the ``tag`` and
    ``safe_serialization`` this function has always taken by position.
    """
    directory_form = output_is_directory(output)
    if not directory_form and max_shard_size is not None:
        raise ValueError(
            f"max_shard_size applies to an output directory; {output} names one file (give a "
            "directory, e.g. a path without a weight-file suffix, to get shards)"
        )
    if directory_form:
        parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
    state_dict = get_fp32_state_dict_from_zero_checkpoint(
        checkpoint_dir, tag, exclude_frozen_parameters, allow_symlinks
    )
    if directory_form:
        return write_weights_directory(
            state_dict,
            output,
            safe_serialization,
            DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size,
        )
    path = Path(output)
    size = (write_safetensors if safe_serialization else write_torch)(state_dict, path)
    return WrittenWeights({path.name: size}, [], ShardPlan({path.name: list(state_dict)}, size))


def _natural_key(text: str) -> list:
    """Sort key with digit runs compared as numbers: ``zero_2_...`` before ``zero_10_...``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def get_checkpoint_files(checkpoint_dir, glob_pattern: str) -> list[str]:
    """DeepSpeed's helper: the files of ``checkpoint_dir`` matching ``glob_pattern``, in natural
    order (rank 2 before rank 10); FileNotFoundError naming the pattern when there are none."""
    files = sorted(glob.glob(os.path.join(checkpoint_dir, glob_pattern)), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"can't find {glob_pattern} files in directory '{checkpoint_dir}'")
    return files


def get_optim_files(checkpoint_dir) -> list[str]:
    """The ``*_optim_states.pt`` files of a DeepSpeed checkpoint folder, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_optim_states.pt")


def get_model_state_files(checkpoint_dir) -> list[str]:
    """The ``*_model_states.pt`` files of a DeepSpeed checkpoint folder, in rank order."""
    return get_checkpoint_files(checkpoint_dir, "*_model_states.pt")


def _parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or "python -m deepspeed_cpp.utils.zero_to_fp32",
        description="Consolidate a deepspeed_cpp ZeRO checkpoint into fp32 weights: into an "
        "output directory as DeepSpeed's zero_to_fp32 does (pytorch_model.bin or "
        "model.safetensors, sharded with an index past --max_shard_size), or into one file.",
    )
    parser.add_argument(
        "checkpoint_dir",
        help="the save_checkpoint folder (with 'latest'), e.g. path/checkpoint-12, or a tag folder",
    )
    parser.add_argument(
        "output_dir",
        help="an output directory (an existing one, or a new path without a weight-file suffix, "
        "e.g. path/checkpoint-12-output/), or one output file: a new path ending in "
        f"{', '.join(FILE_SUFFIXES)} (e.g. pytorch_model.bin), or an existing file",
    )
    parser.add_argument(
        "--max_shard_size",
        default=None,
        help=f"largest shard in an output directory, e.g. 500MB (default {DEFAULT_MAX_SHARD_SIZE}"
        "; decimal units KB, MB, GB, TB; a tensor larger than it gets a shard of its own)",
    )
    parser.add_argument(
        "--safe_serialization", action="store_true", help="write safetensors instead of torch"
    )
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: 'latest')")
    parser.add_argument(
        "--exclude_frozen_parameters",
        action="store_true",
        help="leave out the parameters that were not trained",
    )
    parser.add_argument(
        "-d",
        "--debug",
        action="store_true",
        help="list every tensor and its file; show the traceback of an error",
    )
    parser.add_argument(
        "--allow_symlinks",
        action="store_true",
        help="follow symbolic links in the checkpoint folder (latest, the tag folder, its files)",
    )
    return parser


def _report(written: WrittenWeights, output, debug: bool) -> None:
    folder = Path(output) if output_is_directory(output) else Path(output).parent
    if debug:
        for file_name, names in written.plan.files.items():
            for name in names:
                print(f"zero_to_fp32: {name} -> {file_name}")
    for file_name, size in written.files.items():
        print(f"zero_to_fp32: wrote {folder / file_name} ({size / 1e6:.1f} MB)")
    for file_name in written.removed:
        print(f"zero_to_fp32: removed {folder / file_name}, left by an earlier conversion")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """The command line; returns the exit status (errors: one line on stderr, status 1)."""
    args = _parser(prog).parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir,
            args.output_dir,
            args.tag,
            args.safe_serialization,
            args.allow_symlinks,
            max_shard_size=args.max_shard_size,
            exclude_frozen_parameters=args.exclude_frozen_parameters,
        )
    except (
        OSError,
        ValueError,
        ImportError,
        IncompleteCheckpointError,
        CheckpointMismatchError,
    ) as error:
        if args.debug:
            raise
        # One line: the message names the file and what is wrong; a traceback adds nothing.
        print(f"zero_to_fp32: {error}", file=sys.stderr)
        return 1
    _report(written, args.output_dir, args.debug)
    return 0


if __name__ == "__main__":
    sys.exit(main())
