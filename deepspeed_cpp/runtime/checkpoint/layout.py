"""Where a checkpoint's files live, and how a reader finds a complete one.

```
save_dir/
  latest                                   the tag of the newest complete checkpoint
  <tag>/
    mp_rank_00_model_states.pt             rank 0: module state_dict, counters, scheduler, scaler
                                           (MoE experts excepted: see expert_files.py)
    layer_<L>_expert_<E>_mp_rank_00_model_states.pt   expert E of MoE layer L (expert_files.py)
    zero_pp_rank_<r>_mp_rank_00_optim_states.pt   rank r: its fp32 master slices, optimizer
                                           state for them, its RNG states
    client_state.pt                        rank 0: the client_state dict given to save
    checkpoint_meta.json                   written last: plain-data layout (see metadata.py)
  <tag>.partial/                           a save in progress (or one that crashed)
```

A tag directory is only ever created by renaming a finished ``<tag>.partial`` directory that
already holds its metadata, and the metadata lists every other file with its size, so "has a
readable metadata file whose files are all present with those sizes" is what "complete" means;
"undamaged" is each file's SHA-256, also in the metadata, checked as the file is read.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .digests import check_metadata
from .errors import CheckpointNotFoundError, IncompleteCheckpointError

FORMAT_NAME = "deepspeed_cpp.zero_checkpoint"
FORMAT_VERSION = 1
LATEST_FILE = "latest"
METADATA_FILE = "checkpoint_meta.json"
MODULE_FILE = "mp_rank_00_model_states.pt"
CLIENT_STATE_FILE = "client_state.pt"
STAGING_SUFFIX = ".partial"
DISPLACED_SUFFIX = ".replaced"


def optimizer_shard_file(rank: int) -> str:
    """The name of rank ``rank``'s shard file (DeepSpeed's name for it)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def check_tag(tag) -> str:
    """A tag names one directory inside ``save_dir``; anything else is refused by value."""
    text = str(tag)
    if (
        not text
        or text in (".", "..", LATEST_FILE)
        or "/" in text
        or os.sep in text
        or text.endswith((STAGING_SUFFIX, DISPLACED_SUFFIX))
    ):
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable: a tag must be one directory name, not "
            f"'latest', '.', '..', and without '/' or the suffixes '{STAGING_SUFFIX}' and "
            f"'{DISPLACED_SUFFIX}'"
        )
    return text


def read_latest_tag(save_dir: str | os.PathLike) -> str | None:
    """The tag in ``save_dir/latest``, or None when there is no such file."""
    path = Path(save_dir) / LATEST_FILE
    try:
        tag = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    if not tag:
        raise IncompleteCheckpointError(f"{path} is empty; it should hold a checkpoint tag")
    return tag


def _tags_in(save_dir: Path) -> list[str]:
    if not save_dir.is_dir():
        return []
    return sorted(p.name for p in save_dir.iterdir() if (p / METADATA_FILE).is_file())


def read_metadata(checkpoint_dir: str | os.PathLike) -> dict:
    """Reads and checks ``checkpoint_dir/checkpoint_meta.json``.

    Raises CheckpointNotFoundError when the directory does not exist and
    IncompleteCheckpointError when the metadata, or a file it lists, is missing or has another
    size than the one recorded at save time, or when the metadata's own digest does not match
    (the files' digests are checked as they are read, see ``digests.py``).
    """
    directory = Path(checkpoint_dir)
    if not directory.is_dir():
        hints = []
        for suffix, meaning in (
            (STAGING_SUFFIX, "a save of this tag that did not finish"),
            (
                DISPLACED_SUFFIX,
                "the previous checkpoint of this tag, displaced by a re-save "
                "that stopped between two renames; the next save renames it back, or rename it "
                "back by hand to use it",
            ),
        ):
            sibling = directory.with_name(directory.name + suffix)
            if sibling.exists():
                hints.append(f"{sibling} exists: {meaning}")
        complete = _tags_in(directory.parent)
        hints.append(
            f"complete checkpoints in {directory.parent}: {complete}"
            if complete
            else f"no complete checkpoint in {directory.parent}"
        )
        raise CheckpointNotFoundError(
            f"checkpoint directory {directory} does not exist; " + "; ".join(hints)
        )
    metadata_path = directory / METADATA_FILE
    if not metadata_path.is_file():
        present = sorted(p.name for p in directory.iterdir())
        raise IncompleteCheckpointError(
            f"checkpoint {directory} is incomplete: {METADATA_FILE} is missing (it is written "
            f"last, so the save did not finish, or the directory was not written by "
            f"deepspeed_cpp); files present: {present}"
        )
    try:
        metadata = json.loads(metadata_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise IncompleteCheckpointError(f"{metadata_path} cannot be read: {error}") from error
    if metadata.get("format") != FORMAT_NAME or metadata.get("version", 0) > FORMAT_VERSION:
        raise IncompleteCheckpointError(
            f"{metadata_path} has format {metadata.get('format')!r} version "
            f"{metadata.get('version')!r}; this deepspeed_cpp reads {FORMAT_NAME!r} up to "
            f"version {FORMAT_VERSION}"
        )
    check_metadata(metadata, metadata_path)
    for entry in metadata["files"]:
        path = directory / entry["name"]
        if not path.is_file():
            raise IncompleteCheckpointError(
                f"checkpoint {directory} is incomplete: {entry['name']} ({entry['role']}) is "
                f"missing"
            )
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise IncompleteCheckpointError(
                f"checkpoint {directory} is damaged: {entry['name']} ({entry['role']}) has "
                f"{size} bytes, {entry['bytes']} were written"
            )
    return metadata


def resolve_checkpoint_dir(checkpoint_dir: str | os.PathLike, tag: str | None) -> Path:
    """The tag directory for ``tag``, or for the tag in ``checkpoint_dir/latest``.

    ``checkpoint_dir`` may also be a tag directory itself (it holds the metadata file), as
    DeepSpeed's zero_to_fp32 accepts. Raises CheckpointNotFoundError naming what is missing.
    """
    base = Path(checkpoint_dir)
    if tag is None:
        if (base / METADATA_FILE).is_file():
            return base
        tag = read_latest_tag(base)
        if tag is None:
            raise CheckpointNotFoundError(
                f"{base / LATEST_FILE} does not exist and no tag was given; complete "
                f"checkpoints in {base}: {_tags_in(base)}"
            )
    return base / tag
