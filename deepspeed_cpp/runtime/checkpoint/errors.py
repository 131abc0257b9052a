"""The errors checkpoint saving and loading raise; each message names the file, key or value."""

from __future__ import annotations

import re


class CheckpointNotFoundError(FileNotFoundError):
    """The checkpoint (its directory or tag) does not exist."""


class IncompleteCheckpointError(RuntimeError):
    """The checkpoint's directory exists but a file it needs is missing, short or unreadable."""


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit this engine: other parameters, shapes, groups or optimizer."""


class ModelParallelMismatchError(CheckpointMismatchError):
    """The checkpoint was written at another model-parallel size (or rank) than this engine's
    mpu has; resharding across model-parallel sizes is not supported."""


class CheckpointSaveError(RuntimeError):
    """Some rank could not write its part; nothing was published and ``latest`` did not move."""


class PickleNotAllowedError(ValueError):
    """The checkpoint's client state needs full unpickling (it was saved with
    ``allow_pickle=True``) and the caller did not pass ``allow_pickle=True`` to load it."""


class UnsafeCheckpointError(IncompleteCheckpointError):
    """The checkpoint holds something loading refuses to follow or unpickle: a file with objects
    other than tensors and plain data, a symbolic link (without ``allow_symlinks=True``), or a
    name that leads out of the save folder."""


_REFUSED_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def not_weights_only(path, role: str, error: Exception) -> UnsafeCheckpointError:
    """The error for a file that ``torch.load(weights_only=True)`` refused. torch's own text is
    left out on purpose: it advises ``weights_only=False``, which would run the file's code."""
    refused = _REFUSED_GLOBAL.search(str(error))
    named = f" (it names {refused.group(1)})" if refused else ""
    return UnsafeCheckpointError(
        f"checkpoint file {path} ({role}): this file holds objects that are not tensors{named}; "
        "it was not written by deepspeed_cpp or it was tampered with. deepspeed_cpp never "
        "unpickles such objects: doing so could run code from the file"
    )
