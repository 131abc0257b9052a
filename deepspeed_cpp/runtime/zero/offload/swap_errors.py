"""The errors of swap-file I/O: each names the file, the bytes and errno."""

from __future__ import annotations

import errno as errno_module
import os
from typing import Any


def errno_text(code: int) -> str:
    """``"ENOSPC (28): No space left on device"``."""
    name = errno_module.errorcode.get(code, "errno")
    return f"{name} ({code}): {os.strerror(code)}"


class SwapFileError(OSError):
    """A swap file or folder could not be made, written or read.

    The message names the path, the byte count where there is one, and the OS error as
    ``ENOSPC (28): No space left on device``; ``errno``, ``filename`` and ``nbytes`` hold them.
    """

    def __init__(
        self, message: str, *, errno: int | None = None, path: Any = None, nbytes: int | None = None
    ) -> None:
        super().__init__(message)
        self.errno = errno
        self.strerror = os.strerror(errno) if errno is not None else None
        self.filename = None if path is None else os.fspath(path)
        self.nbytes = nbytes
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):
        kwargs = dict(errno=self.errno, path=self.filename, nbytes=self.nbytes)
        return _rebuild_error, (type(self), self.message, kwargs)


class StaleSwapFileError(SwapFileError):
    """A swap file whose header does not match this run, this key or the expected size."""


def _rebuild_error(cls, message, kwargs):
    return cls(message, **kwargs)


def os_error(what: str, error: OSError, path: Any, nbytes: int | None = None) -> SwapFileError:
    code = error.errno if error.errno is not None else errno_module.EIO
    size = f" ({nbytes} bytes)" if nbytes is not None else ""
    return SwapFileError(
        f"{what}{size}: '{os.fspath(path)}': {errno_text(code)}",
        errno=code,
        path=path,
        nbytes=nbytes,
    )
