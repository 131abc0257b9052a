"""Durable, all-or-nothing file and directory writes.

A file is written under a temporary name in its final directory, flushed and fsynced, renamed
over the final name (atomic on POSIX file systems), and then the directory itself is fsynced so
that the rename survives a power cut. A reader therefore sees either the old file, or the whole
new one, never a prefix. Directories are published the same way: built under a staging name,
then renamed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from .digests import HashingWriter


def fsync_directory(directory: str | os.PathLike) -> None:
    """Makes the directory's entries (creations, renames) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temporary_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> int:
    """Calls ``write(file)`` on a temporary file, then publishes it as ``path``.

    Returns the size of the published file in bytes. If ``write`` raises, the temporary file is
    removed and ``path`` is left as it was.
    """

    def write_and_sync(temporary: Path) -> None:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())

    return _publish_file(Path(path), write_and_sync)


def write_atomically_by_name(path: str | os.PathLike, write: Callable[[Path], None]) -> int:
    """As ``write_atomically``, for writers that take a file name (``write(temporary_path)``)."""

    def write_and_sync(temporary: Path) -> None:
        write(temporary)
        with open(temporary, "rb+") as handle:
            os.fsync(handle.fileno())

    return _publish_file(Path(path), write_and_sync)


def _free_bytes(directory: Path) -> str:
    try:
        stats = os.statvfs(directory)
    except OSError:
        return "the free space there is unknown (the directory cannot be read)"
    return f"{stats.f_bavail * stats.f_frsize} bytes are free on that file system"


def _write_error(path: Path, temporary: Path, error: OSError) -> OSError:
    """``error`` (same errno, so the same OSError subclass) naming the file being published,
    how far the write got and the free space: a full disk, a file size limit (EFBIG), a
    read-only file system and a vanished directory all look alike without them."""
    try:
        written = (
            f"{temporary.stat().st_size} bytes of it were written under the temporary name "
            f"{temporary.name}, which was removed"
        )
    except OSError:
        written = f"its temporary file {temporary.name} could not be created or is gone"
    reason = error.strerror or str(error)
    return OSError(
        error.errno,
        f"could not write {path}: {reason}; {written}, and {path.name} was left as it was; "
        f"{_free_bytes(path.parent)}",
    )


def _publish_file(path: Path, write_and_sync: Callable[[Path], None]) -> int:
    """Runs ``write_and_sync(temporary)``, renames the temporary file over ``path`` and makes
    the rename durable; on any error the temporary file is removed (an OSError is raised again
    naming ``path`` and the bytes written). Returns the file size."""
    temporary = _temporary_name(path)
    try:
        write_and_sync(temporary)
        size = temporary.stat().st_size
        os.replace(temporary, path)
    except OSError as error:
        described = _write_error(path, temporary, error)
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise described from error
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    fsync_directory(path.parent)
    return size


def save_torch_atomically(obj, path: str | os.PathLike) -> tuple[int, str]:
    """``torch.save(obj)`` to ``path``, atomically; returns the file's size in bytes and its
    SHA-256, hashed from the stream as it is written (no second read of the file)."""
    writers: list[HashingWriter] = []

    def write(handle: BinaryIO) -> None:
        writers.append(HashingWriter(handle))
        torch.save(obj, writers[-1])

    size = write_atomically(path, write)
    return size, writers[-1].hexdigest()


def write_text_atomically(path: str | os.PathLike, text: str) -> int:
    """Writes UTF-8 text to ``path``, atomically; returns the file size in bytes."""
    return write_atomically(path, lambda handle: handle.write(text.encode("utf-8")))


def remove_tree(path: str | os.PathLike) -> None:
    """Removes a directory tree if it exists; a symbolic link is removed itself, never what it
    points to (a tag folder linked from elsewhere is the user's data, not the save's)."""
    if Path(path).is_symlink():
        os.unlink(path)
    elif Path(path).exists():
        shutil.rmtree(path)


def _reason(error: OSError) -> str:
    return error.strerror or str(error) or type(error).__name__


def publish_directory(staging: Path, final: Path, displaced: Path) -> str | None:
    """Renames the finished ``staging`` directory to ``final``.

    An existing ``final`` (a checkpoint saved again under the same tag) is first renamed to
    ``displaced`` and removed afterwards, so that ``final`` is at every moment either the whole
    old directory, the whole new one, or (for the instant between two renames) absent, with the
    old one still on disk under ``displaced``. If the second rename fails, the old directory is
    renamed back to ``final`` before the error is raised.

    Once ``final`` is published, failing to remove ``displaced`` does not undo it: the return
    value then says what was left where and why (None when nothing was); the next save into the
    folder tries the removal again (``interrupted_saves.py``).
    """
    remove_tree(displaced)
    if final.exists():
        os.replace(final, displaced)
    try:
        os.replace(staging, final)
    except OSError as error:
        if not displaced.exists():
            raise
        try:
            os.replace(displaced, final)  # put the old checkpoint back under its name
        except OSError as restore_error:
            raise OSError(
                error.errno,
                f"{error.strerror}; and the previous {final.name} could not be renamed back "
                f"from {displaced} ({restore_error.strerror}): rename it by hand",
            ) from error
        raise OSError(
            error.errno, f"{error.strerror}; the previous {final} was restored"
        ) from error
    fsync_directory(final.parent)
    try:
        remove_tree(displaced)
    except OSError as error:
        return (
            f"the previous copy of {final.name} was left at {displaced}: it could not be "
            f"removed ({_reason(error)}{f': {error.filename}' if error.filename else ''})"
        )
    return None
