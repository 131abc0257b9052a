"""One save at a time per ``save_dir``: a second training saving into the same folder is refused.

Two trainings saving into one ``save_dir`` would move ``latest`` back and forth between their
tags, and a save removes what a crashed save of its tag left (``<tag>.partial``), which could be
the other training's save in progress. So rank 0 holds an exclusive ``flock`` on
``save_dir/.deepspeed_cpp_save.lock`` from before it creates the staging directory until the
save is published or has failed. The kernel drops the lock when the process exits, however it
exits, so a crashed save never leaves the folder locked. While held, the file names its holder's
pid and host for the message a refused save gives. Loading takes no lock: a reader follows
``latest``, which only ever names a complete checkpoint.

The file exists only while a save runs: the holder deletes it before it lets the lock go, so a
saved folder holds no trace of it (the Hugging Face integration saves into each
``checkpoint-N/``, which users copy and upload). Deleting a lock file is safe only because a
taker checks, once it holds the lock, that the file it locked is still the one at the path; if
a releaser deleted it meanwhile, the taker starts again with the new file.

The save folder may be shared or prepared by someone else, so the lock is opened without
following a symbolic link and must be a regular file with no other name (a hard link): a save
never truncates a file the lock path merely points to.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

from .errors import CheckpointSaveError

LOCK_FILE = ".deepspeed_cpp_save.lock"
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class SaveLock:
    """The lock of one ``save_dir`` (rank 0 acquires it; ``release`` is safe to call always)."""

    def __init__(self, save_dir: Path):
        self.path = Path(save_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = self._open()
            try:
                if self._locked_current_file(fd):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # a releaser deleted the file we locked: take the new one
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
            try:
                if _same_file(fd, self.path):
                    os.unlink(self.path)  # while still held: see the module doc
            except OSError:
                pass  # the folder went away or turned read-only: the file may stay, harmless
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)

    def _open(self) -> int:
        try:
            fd = os.open(self.path, _OPEN_FLAGS, 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise CheckpointSaveError(
                    f"the save lock {self.path} is a symbolic link; deepspeed_cpp never follows "
                    "it (a save would write where it points): remove it"
                ) from None
            if error.errno == errno.EISDIR:
                raise CheckpointSaveError(_not_a_file(self.path, "a directory")) from None
            raise OSError(
                error.errno, f"could not create the save lock {self.path}: {error.strerror}"
            ) from error
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise CheckpointSaveError(_not_a_file(self.path, _kind(mode)))
        return fd

    def _locked_current_file(self, fd: int) -> bool:
        """Takes `fd`'s lock (refused, naming the holder, when another save holds it); returns
        whether `fd` is still the file at the lock's path."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            raise CheckpointSaveError(
                f"another training is saving into {self.path.parent} ({holder} holds "
                f"{self.path}); two trainings must not share a save_dir: give this one its own"
            ) from None
        if not _same_file(fd, self.path):
            return False
        if os.fstat(fd).st_nlink != 1:
            raise CheckpointSaveError(
                f"the save lock {self.path} has other names (a hard link to another file); "
                "expected the file deepspeed_cpp makes there: remove it"
            )
        return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)


def _not_a_file(path: Path, kind: str) -> str:
    return (
        f"the save lock {path} is not a regular file ({kind}); expected the file "
        "deepspeed_cpp makes there: remove it"
    )


def _kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket"}
    return next((name for test, name in kinds.items() if test(mode)), "a device or special file")
