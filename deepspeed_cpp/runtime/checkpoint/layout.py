"""Where a checkpoint's files live, and how a reader finds a complete one.

```
save_dir/
  latest                                   the tag of the newest complete checkpoint
  zero_to_fp32.py                          runs deepspeed_cpp's consolidator (recovery_script.py);
                                           in no checkpoint's file list
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

With model parallelism (``initialize(mpu=...)``, model-parallel size M > 1) each model-parallel
rank's data-parallel group writes a complete checkpoint of the above shape, of its own part of
the model, under a folder of its own, so that ranks holding different slices never overwrite
each other and every part is published atomically with its own ``latest``::

  save_dir/mp_rank_00/latest, save_dir/mp_rank_00/<tag>/...   model-parallel rank 0's part
  save_dir/mp_rank_01/...                                     model-parallel rank 1's part

Each part's metadata records ``model_parallel`` (``{"rank": m, "world_size": M}``); loading
needs the same model-parallel size (``model_parallel_dir``). Resharding across model-parallel
sizes is the tensor-parallel and pipeline layers' job.

A tag directory is only ever created by renaming a finished ``<tag>.partial`` directory that
already holds its metadata, and the metadata lists every other file with its size, so "has a
readable metadata file whose files are all present with those sizes" is what "complete" means;
"undamaged" is each file's SHA-256, also in the metadata, checked as the file is read.

Paths stay inside ``save_dir``: a tag, whether given to save or load or read from ``latest``, is
one directory name (``check_tag``); the files a checkpoint lists are plain names inside its tag
folder; and a reader follows no symbolic link (``latest``, a tag folder, a listed file) unless
its caller passes ``allow_symlinks=True``. A checkpoint folder is often downloaded or shared, and
these names are its data, not the user's choice.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

from .digests import check_metadata
from .errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    ModelParallelMismatchError,
    UnsafeCheckpointError,
)

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


def model_parallel_folder(mp_rank: int) -> str:
    """The folder of model-parallel rank ``mp_rank``'s part (model-parallel size > 1)."""
    return f"mp_rank_{mp_rank:02d}"


def model_parallel_dir(save_dir, mp_rank: int, mp_world_size: int, *, loading: bool) -> Path:
    """Where this model-parallel rank's checkpoints live: ``save_dir`` itself at model-parallel
    size 1, else ``save_dir/mp_rank_XX``. When ``loading``, ModelParallelMismatchError if the
    folder was written at another model-parallel size (told by which ``mp_rank_XX`` folders
    exist; each part's metadata is checked again when read)."""
    base = Path(save_dir)
    if not loading:
        return base if mp_world_size == 1 else base / model_parallel_folder(mp_rank)
    saved_parts = sorted(p.name for p in base.glob("mp_rank_[0-9][0-9]") if p.is_dir())
    if mp_world_size == 1:
        if saved_parts and not (base / LATEST_FILE).exists():
            raise ModelParallelMismatchError(
                f"{base} holds a checkpoint saved with model parallelism (parts {saved_parts}); "
                "this engine has none (model-parallel size 1): load it with an mpu of model-"
                f"parallel size {len(saved_parts)}"
            )
        return base
    if base.is_dir() and not saved_parts and (base / LATEST_FILE).exists():
        raise ModelParallelMismatchError(
            f"{base} holds a checkpoint saved without model parallelism (model-parallel size "
            f"1); this engine's mpu has model-parallel size {mp_world_size}"
        )
    if saved_parts and len(saved_parts) != mp_world_size:
        raise ModelParallelMismatchError(
            f"{base} holds a checkpoint of model-parallel size {len(saved_parts)} (parts "
            f"{saved_parts}); this engine's mpu has model-parallel size {mp_world_size}: loading "
            "at another model-parallel size is not supported"
        )
    return base / model_parallel_folder(mp_rank)


def check_model_parallel_metadata(metadata: dict, mp_rank: int, mp_world_size: int, where) -> None:
    """ModelParallelMismatchError unless the part's metadata was written by model-parallel rank
    ``mp_rank`` of ``mp_world_size`` (metadata without the key: size 1)."""
    saved = metadata.get("model_parallel", {"rank": 0, "world_size": 1})
    if saved != {"rank": mp_rank, "world_size": mp_world_size}:
        raise ModelParallelMismatchError(
            f"checkpoint {where} was written by model-parallel rank {saved.get('rank')} of "
            f"{saved.get('world_size')}; this rank is model-parallel rank {mp_rank} of "
            f"{mp_world_size}"
        )


def _is_plain_name(text: str) -> bool:
    return (
        bool(text) and text not in (".", "..") and not any(c in text for c in ("/", os.sep, "\0"))
    )


def check_tag(tag) -> str:
    """A tag names one directory inside ``save_dir``; anything else is refused by value."""
    text = str(tag)
    if (
        not _is_plain_name(text)
        or text == LATEST_FILE
        or text.endswith((STAGING_SUFFIX, DISPLACED_SUFFIX))
    ):
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable: a tag must be one directory name, not "
            f"'latest', '.', '..', and without '/' or the suffixes '{STAGING_SUFFIX}' and "
            f"'{DISPLACED_SUFFIX}'"
        )
    return text


def _symlink_refused(path: Path, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} ({what}) is a symbolic link; loading follows none (it could lead out of the "
        "checkpoint folder): pass allow_symlinks=True if you made it and trust where it points"
    )


def read_latest_tag(save_dir: str | os.PathLike, allow_symlinks: bool = False) -> str | None:
    """The tag in ``save_dir/latest``, or None when there is no such file. A ``latest`` that is
    not a regular file, is a symbolic link (unless ``allow_symlinks``) or names anything but a
    tag inside ``save_dir`` raises UnsafeCheckpointError naming it."""
    path = Path(save_dir) / LATEST_FILE
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if allow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _symlink_refused(path, "the file naming the newest checkpoint") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeCheckpointError(f"{path} is not a regular file; it should hold a tag")
        data = os.read(fd, 4096)
    finally:
        os.close(fd)
    tag = data.decode("utf-8", "replace").strip()
    if not tag:
        raise IncompleteCheckpointError(f"{path} is empty; it should hold a checkpoint tag")
    try:
        return check_tag(tag)
    except ValueError as error:
        raise UnsafeCheckpointError(
            f"{path} names {tag[:200]!r}, which is not a checkpoint inside {save_dir}: {error}"
        ) from None


def tag_directory(save_dir: str | os.PathLike, tag, allow_symlinks: bool = False) -> Path:
    """``save_dir/<tag>`` for a tag to load (ValueError naming it when it is not one directory
    name, see ``check_tag``); UnsafeCheckpointError when that folder is a symbolic link and
    ``allow_symlinks`` is not set."""
    directory = Path(save_dir) / check_tag(tag)
    if not allow_symlinks and directory.is_symlink():
        raise _symlink_refused(directory, f"the folder of checkpoint tag {str(tag)!r}")
    return directory


def listed_file(directory: Path, name: str, listed, role: str) -> Path:
    """``directory/name`` for a file that the metadata's file list (``listed``) holds, so that
    its name was checked by ``read_metadata``; IncompleteCheckpointError otherwise."""
    if name not in listed:
        raise IncompleteCheckpointError(
            f"checkpoint {directory} is incomplete: {name!r} ({role}) is not among the files "
            f"{METADATA_FILE} lists"
        )
    return directory / name


def _tags_in(save_dir: Path) -> list[str]:
    if not save_dir.is_dir():
        return []
    return sorted(p.name for p in save_dir.iterdir() if (p / METADATA_FILE).is_file())


def read_metadata(checkpoint_dir: str | os.PathLike, allow_symlinks: bool = False) -> dict:
    """Reads and checks ``checkpoint_dir/checkpoint_meta.json``.

    Raises CheckpointNotFoundError when the directory does not exist and
    IncompleteCheckpointError when the metadata, or a file it lists, is missing or has another
    size than the one recorded at save time, or when the metadata's own digest does not match
    (the files' digests are checked as they are read, see ``digests.py``). UnsafeCheckpointError
    when a listed name is not a file name in ``checkpoint_dir``, or (unless ``allow_symlinks``)
    the metadata or a listed file is a symbolic link.
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
    if not allow_symlinks and metadata_path.is_symlink():
        raise _symlink_refused(metadata_path, "checkpoint metadata")
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
        name = entry["name"]
        if not isinstance(name, str) or not _is_plain_name(name):
            raise UnsafeCheckpointError(
                f"{metadata_path} lists the file {name!r}, which is not a file name inside "
                f"{directory}"
            )
        path = directory / name
        if not allow_symlinks and path.is_symlink():
            raise _symlink_refused(path, entry.get("role", "checkpoint file"))
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


def resolve_checkpoint_dir(
    checkpoint_dir: str | os.PathLike, tag: str | None, allow_symlinks: bool = False
) -> Path:
    """The tag directory for ``tag``, or for the tag in ``checkpoint_dir/latest``, through the
    checks of ``tag_directory`` and ``read_latest_tag``.

    ``checkpoint_dir`` may also be a tag directory itself (it holds the metadata file), as
    DeepSpeed's zero_to_fp32 accepts. Raises CheckpointNotFoundError naming what is missing.
    """
    base = Path(checkpoint_dir)
    if tag is None:
        if (base / METADATA_FILE).is_file():
            return base
        tag = read_latest_tag(base, allow_symlinks)
        if tag is None:
            raise CheckpointNotFoundError(
                f"{base / LATEST_FILE} does not exist and no tag was given; complete "
                f"checkpoints in {base}: {_tags_in(base)}"
            )
    return tag_directory(base, tag, allow_symlinks)
