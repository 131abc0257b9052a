"""The errors checkpoint saving and loading raise; each message names the file, key or value."""

from __future__ import annotations


class CheckpointNotFoundError(FileNotFoundError):
    """The checkpoint (its directory or tag) does not exist."""


class IncompleteCheckpointError(RuntimeError):
    """The checkpoint's directory exists but a file it needs is missing, short or unreadable."""


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit this engine: other parameters, shapes, groups or optimizer."""


class CheckpointSaveError(RuntimeError):
    """Some rank could not write its part; nothing was published and ``latest`` did not move."""


class PickleNotAllowedError(ValueError):
    """The checkpoint's client state needs full unpickling (it was saved with
    ``allow_pickle=True``) and the caller did not pass ``allow_pickle=True`` to load it."""
