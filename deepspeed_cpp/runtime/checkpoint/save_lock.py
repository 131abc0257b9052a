"""One save at a time per ``save_dir``: a second training saving into the same folder is refused.

Two trainings saving into one ``save_dir`` would move ``latest`` back and forth between their
tags, and a save removes what a crashed save of its tag left (``<tag>.partial``), which could be
the other training's save in progress. So rank 0 holds an exclusive ``flock`` on
``save_dir/.deepspeed_cpp_save.lock`` from before it creates the staging directory until the
save is published or has failed. The kernel drops the lock when the process exits, however it
exits, so a crashed save never leaves the folder locked; the file itself stays, holding the last
holder's pid and host for the message a refused save gives. Loading takes no lock: a reader
follows ``latest``, which only ever names a complete checkpoint.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from .errors import CheckpointSaveError

LOCK_FILE = ".deepspeed_cpp_save.lock"


class SaveLock:
    """The lock of one ``save_dir`` (rank 0 acquires it; ``release`` is safe to call always)."""

    def __init__(self, save_dir: Path):
        self.path = Path(save_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise OSError(
                error.errno, f"could not create the save lock {self.path}: {error.strerror}"
            ) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise CheckpointSaveError(
                f"another training is saving into {self.path.parent} ({holder} holds "
                f"{self.path}); two trainings must not share a save_dir: give this one its own"
            ) from None
        holder = f"pid {os.getpid()} on {socket.gethostname()}".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder, 0)
        self._fd = fd

    @property
    def held(self) -> bool:
        """Whether this process holds the lock (rank 0 after ``acquire``)."""
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
