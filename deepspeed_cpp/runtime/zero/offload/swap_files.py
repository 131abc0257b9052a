"""Swap files for ZeRO-Offload to NVMe: one file per key in a folder private to this run.

``SwapFolder`` keeps tensors (a sub-group's optimizer state, a parameter shard) in files under
the user's ``nvme_path`` and moves them with the asynchronous I/O op (`AsyncIOHandle`)::

    folder = SwapFolder("/local_nvme", purpose="optimizer", rank=0, aio=AioSettings())
    ticket = folder.write("group0", state)      # returns at once; `state` must stay unchanged
    ...                                         # until ticket.wait()
    folder.read("group0", into=state).wait()
    folder.close()                              # also run at interpreter exit

Layout: ``<nvme_path>/deepspeed_cpp_swap/<purpose>-<host>-pid<pid>-rank<rank>-<run_id>/``
holds one ``<key>.swp`` per key (the key percent-encoded) and an ``owner`` file (the creating
process's pid and start time). Each swap file is a 4096-byte header followed by the tensor's
bytes, so the data sits at a 4096-aligned offset and moves with O_DIRECT.

The header names the run, the key, the dtype, the element count, a per-key generation and
whether the data behind it is complete; a CRC covers it. A write first marks the header
incomplete (and cuts the file to its new size), then writes the data, and marks the header
complete only after the data write succeeded: a file is never taken as valid unless the whole
write of this run, this key and this size finished. Reads check the header and the file size
before anything is read (``StaleSwapFileError`` names the file and what did not match).

Transfers complete independently: each one in flight has its own aio handle (a pool of
``max_in_flight``, made as needed) and a thread of the pool that waits for it, so waiting for a
read never waits for an unrelated write, and ``SwapTicket.done()`` never blocks. When all
handles are busy, ``write``/``read`` wait until one is free. Transfers of the same key run in
the order they were asked for. No memory proportional to the tensors is allocated here.

Folders left by runs that died (killed, crashed, exited without ``close``) are removed when a
new ``SwapFolder`` is made under the same ``nvme_path``: only folders named as ours, made on
this host, whose process is gone. ``close()`` removes this run's files and folder; it also runs
when the object is garbage-collected and at interpreter exit (never in a forked child).
"""

from __future__ import annotations

import errno as errno_module
import json
import os
import queue
import re
import secrets
import shutil
import socket
import struct
import threading
import urllib.parse
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ....utils.logging import logger

ROOT_NAME = "deepspeed_cpp_swap"
HEADER_BYTES = 4096
FORMAT_VERSION = 1
_MAGIC = b"DSCPPSWP"
_SUFFIX = ".swp"
_OWNER_FILE = "owner"
# magic, version, complete, generation, run_id, dtype, numel, nbytes, key length, crc32
_HEADER = struct.Struct("<8sIIQ32s16sQQII")
_KEY_OFFSET = 128
_MAX_KEY_BYTES = HEADER_BYTES - _KEY_OFFSET
_RUN_ID_HEX = 16  # run_id: 16 random hex digits
_PURPOSE = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")
_FOLDER_NAME = re.compile(
    r"(?P<prefix>.+)-pid(?P<pid>[0-9]+)-rank(?P<rank>[0-9]+)-(?P<run_id>[0-9a-f]{"
    + str(_RUN_ID_HEX)
    + "})"
)
_AIO_ERRNO = re.compile(r"errno (\d+)\)")


# --- errors -----------------------------------------------------------------------------------


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


def _os_error(what: str, error: OSError, path: Any, nbytes: int | None = None) -> SwapFileError:
    code = error.errno if error.errno is not None else errno_module.EIO
    size = f" ({nbytes} bytes)" if nbytes is not None else ""
    return SwapFileError(
        f"{what}{size}: '{os.fspath(path)}': {errno_text(code)}",
        errno=code,
        path=path,
        nbytes=nbytes,
    )


# --- settings ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AioSettings:
    """The aio handle's settings (DeepSpeed's ``aio`` config section); ``engine`` picks the
    kernel interface as `AsyncIOHandle` does (``"auto"``, ``"io_uring"``, ``"libaio"``,
    ``"threads"``)."""

    block_size: int = 1 << 20
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    engine: str = "auto"

    @classmethod
    def from_config(cls, aio_config) -> AioSettings:
        """From the ``aio`` section: an `AioConfig`, a dict as in the JSON, or None (defaults)."""
        from ...config.errors import DeepSpeedConfigError, describe_validation_error
        from ...config.key_names import model_keys, unknown_key_problem
        from ...config.sections import AioConfig

        if aio_config is None:
            return cls()
        if not isinstance(aio_config, AioConfig):
            from pydantic import ValidationError

            try:
                aio_config = AioConfig.model_validate(aio_config)
            except ValidationError as error:

                def unknown(loc, value):
                    return unknown_key_problem(loc, value, model_keys(AioConfig), ())

                problems = describe_validation_error(error, ("aio",), unknown)
                raise DeepSpeedConfigError(problems) from None
        values = dict(
            block_size=aio_config.block_size,
            queue_depth=aio_config.queue_depth,
            intra_op_parallelism=aio_config.intra_op_parallelism,
            single_submit=aio_config.single_submit,
            overlap_events=aio_config.overlap_events,
        )
        unresolved = [f"aio.{name}" for name, value in values.items() if value == "auto"]
        if unresolved:
            raise ValueError(f'AioSettings.from_config: {", ".join(unresolved)} still "auto"')
        return cls(**values)

    def new_handle(self):
        from ....ops.aio import AsyncIOHandle

        return AsyncIOHandle(
            self.block_size,
            self.queue_depth,
            self.single_submit,
            self.overlap_events,
            self.intra_op_parallelism,
            self.engine,
        )


# --- headers ----------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _encode_header(
    run_id: str, key: str, dtype: torch.dtype, numel: int, generation: int, complete: bool
) -> bytes:
    key_bytes = key.encode()
    nbytes = numel * dtype.itemsize
    fields = (
        _MAGIC,
        FORMAT_VERSION,
        int(complete),
        generation,
        run_id.encode(),
        _dtype_name(dtype).encode(),
        numel,
        nbytes,
        len(key_bytes),
    )
    block = bytearray(HEADER_BYTES)
    _HEADER.pack_into(block, 0, *fields, 0)
    block[_KEY_OFFSET : _KEY_OFFSET + len(key_bytes)] = key_bytes
    struct.pack_into("<I", block, _HEADER.size - 4, zlib.crc32(block))
    return bytes(block)


@dataclass(frozen=True)
class _Header:
    complete: bool
    generation: int
    run_id: str
    dtype: str
    numel: int
    nbytes: int
    key: str


def _decode_header(block: bytes) -> _Header | str:
    """The header, or why the block is not one."""
    if len(block) < HEADER_BYTES:
        return f"the file has only {len(block)} bytes, less than a {HEADER_BYTES}-byte header"
    fields = _HEADER.unpack_from(block, 0)
    magic, version, complete, generation, run_id, dtype, numel, nbytes, key_length, crc = fields
    if magic != _MAGIC:
        return f"no swap-file header (magic {magic!r}, expected {_MAGIC!r})"
    zeroed = bytearray(block[:HEADER_BYTES])
    struct.pack_into("<I", zeroed, _HEADER.size - 4, 0)
    if zlib.crc32(zeroed) != crc:
        return "the header is corrupted (its checksum does not match)"
    if version != FORMAT_VERSION:
        return f"format version {version}, expected {FORMAT_VERSION}"
    key = bytes(block[_KEY_OFFSET : _KEY_OFFSET + key_length]).decode(errors="replace")
    return _Header(
        bool(complete),
        generation,
        run_id.rstrip(b"\0").decode(errors="replace"),
        dtype.rstrip(b"\0").decode(errors="replace"),
        numel,
        nbytes,
        key,
    )


def _file_name(key: str) -> str:
    name = urllib.parse.quote(key, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) > 200:
        import hashlib

        name = name[:120] + "~" + hashlib.sha256(key.encode()).hexdigest()
    return name + _SUFFIX


# --- processes --------------------------------------------------------------------------------


def _host_name() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def _process_start_time(pid: int) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _process_alive(pid: int, start_time: int | None) -> bool:
    """Whether process `pid` runs (not a zombie) and is the one that started at `start_time`."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return False
    except (OSError, IndexError):
        pass
    if start_time is not None:
        now = _process_start_time(pid)
        if now is not None and now != start_time:
            return False  # the pid was reused by another process
    return True


def _is_ours(name: str) -> bool:
    """Files that a SwapFolder makes in its folder (nothing else is ever deleted)."""
    return name == _OWNER_FILE or name.endswith(_SUFFIX)


def _remove_folder(folder: Path) -> tuple[int, int, list[str]]:
    """Deletes our files in `folder`, then the folder if that left it empty; returns (files,
    bytes, names of what was kept)."""
    files, size, kept = 0, 0, []
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0, 0, []
    for entry in entries:
        if _is_ours(entry.name) and entry.is_file(follow_symlinks=False):
            try:
                size += entry.stat(follow_symlinks=False).st_size
                os.unlink(entry.path)
                files += 1
            except FileNotFoundError:
                pass
        else:
            kept.append(entry.name)
    if not kept:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            pass
        except OSError:
            kept.append("(files made meanwhile)")
    return files, size, kept


def remove_stale_folders(nvme_path: str | os.PathLike) -> list[Path]:
    """Removes the swap folders under ``<nvme_path>/deepspeed_cpp_swap`` that runs on this host
    left behind when they died (their process is gone); logs one line each; returns them.
    Folders not named as ours, of other hosts, or of live processes are left alone."""
    root = Path(nvme_path) / ROOT_NAME
    host = _host_name()
    removed = []
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        match = _FOLDER_NAME.fullmatch(entry.name)
        if match is None or not entry.is_dir(follow_symlinks=False):
            continue
        purpose, _, folder_host = match["prefix"].rpartition("-")
        if folder_host != host or not _PURPOSE.fullmatch(purpose):
            continue
        pid = int(match["pid"])
        if _process_alive(pid, _owner_start_time(Path(entry.path), pid)):
            continue
        files, size, kept = _remove_folder(Path(entry.path))
        if kept:
            logger.warning(
                f"swap folder {entry.path} of a run that is gone (pid {pid}) still holds files "
                f"not made by deepspeed_cpp ({', '.join(kept[:5])}); removed {files} swap files "
                f"({size} bytes) and kept the folder"
            )
        else:
            logger.warning(
                f"removed stale swap folder {entry.path}: its run (pid {pid} on this host) is "
                f"gone; {files} swap files, {size} bytes"
            )
        removed.append(Path(entry.path))
    return removed


def _owner_start_time(folder: Path, pid: int) -> int | None:
    try:
        owner = json.loads((folder / _OWNER_FILE).read_text())
        return int(owner["start_time"]) if owner.get("pid") == pid else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


# --- tickets and the handle pool --------------------------------------------------------------


class SwapTicket:
    """One transfer in flight. ``wait()`` blocks until it is done and raises `SwapFileError` if
    it failed (every time it is called); ``done()`` says whether it finished, without blocking."""

    def __init__(self, kind: str, key: str, path: Path, nbytes: int) -> None:
        self.kind, self.key, self.path, self.nbytes = kind, key, path, nbytes
        self._finished = threading.Event()
        self._error: SwapFileError | None = None
        self._reported = False

    def wait(self) -> None:
        self._finished.wait()
        if self._error is not None:
            self._reported = True
            raise self._error

    def done(self) -> bool:
        return self._finished.is_set()

    def _finish(self, error: SwapFileError | None) -> None:
        self._error = error
        self._finished.set()

    def __repr__(self) -> str:
        state = "failed" if self._error else "done" if self.done() else "in flight"
        return f"SwapTicket({self.kind} {self.key!r}, {self.nbytes} bytes, {state})"


_STOP = object()


class _Slot:
    """An aio handle and the thread that waits for its one transfer in flight."""

    def __init__(self, state: _State) -> None:
        self.handle = state.aio.new_handle()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_slot_loop,
            args=(self.handle, self.jobs, state),
            daemon=True,
            name=f"deepspeed_cpp-swap-{state.folder.name[:40]}",
        )
        self.thread.start()


def _slot_loop(handle, jobs: queue.SimpleQueue, state: _State) -> None:
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        slot, ticket, on_success, on_failure = job
        error = None
        try:
            handle.wait()
        except RuntimeError as failure:
            error = _transfer_error(ticket, str(failure))
        if error is None and on_success is not None:
            try:
                on_success()
            except OSError as failure:
                error = _os_error(
                    f"SwapFolder: finishing the {ticket.kind} of key {ticket.key!r}",
                    failure,
                    ticket.path,
                    ticket.nbytes,
                )
        if error is not None and on_failure is not None:
            on_failure()
        ticket._finish(error)
        state.release(slot, ticket)


def _transfer_error(ticket: SwapTicket, aio_message: str) -> SwapFileError:
    found = _AIO_ERRNO.search(aio_message)
    code = int(found.group(1)) if found else errno_module.EIO
    what = "writing" if ticket.kind == "write" else "reading"
    return SwapFileError(
        f"SwapFolder: {what} key {ticket.key!r} ({ticket.nbytes} bytes) "
        f"{'to' if ticket.kind == 'write' else 'from'} '{ticket.path}' failed: "
        f"{errno_text(code)} [aio: {aio_message}]",
        errno=code,
        path=ticket.path,
        nbytes=ticket.nbytes,
    )


@dataclass
class _Entry:
    dtype: torch.dtype
    numel: int
    generation: int
    path: Path


class _State:
    """Everything a SwapFolder owns, without a reference back to it (the finalizer and the
    pool's threads hold this)."""

    def __init__(self, folder: Path, run_id: str, aio: AioSettings, max_in_flight: int) -> None:
        self.folder = folder
        self.run_id = run_id
        self.aio = aio
        self.max_in_flight = max_in_flight
        self.owner_pid = os.getpid()
        self.lock = threading.Condition()
        self.free: list[_Slot] = []
        self.slots: list[_Slot] = []
        self.in_flight: set[SwapTicket] = set()
        self.unreported: list[SwapTicket] = []  # finished with an error, maybe not seen yet
        self.last: dict[str, SwapTicket] = {}  # the latest transfer of each key
        self.entries: dict[str, _Entry] = {}  # keys whose latest write was submitted
        self.generation = 0
        self.closed = False

    def acquire(self) -> _Slot:
        with self.lock:
            while not self.free and len(self.slots) >= self.max_in_flight:
                self.lock.wait()
            if self.free:
                return self.free.pop()
        slot = _Slot(self)  # outside the lock: starting the handle takes a moment
        with self.lock:
            self.slots.append(slot)
        return slot

    def release(self, slot: _Slot, ticket: SwapTicket | None) -> None:
        with self.lock:
            if ticket is not None:
                self.in_flight.discard(ticket)
                if ticket._error is not None:
                    self.unreported.append(ticket)
            self.free.append(slot)
            self.lock.notify_all()

    def wait_all(self) -> list[SwapTicket]:
        """Waits for every transfer; returns the failed ones not yet reported by their wait."""
        with self.lock:
            while self.in_flight:
                self.lock.wait()
            failed = [t for t in self.unreported if not t._reported]
            self.unreported = []
        return failed


def _close_state(state: _State) -> None:
    """Waits for the transfers, stops the pool and deletes the run's files and folder."""
    if state.closed or os.getpid() != state.owner_pid:
        return  # closed already, or a forked child: the folder is the parent's
    for ticket in state.wait_all():
        logger.warning(
            f"SwapFolder closed with a failed transfer never waited for: {ticket._error}"
        )
    state.closed = True
    with state.lock:
        slots, state.slots, state.free = state.slots, [], []
    for slot in slots:
        slot.jobs.put(_STOP)
    for slot in slots:
        slot.thread.join()
    state.entries.clear()
    state.last.clear()
    files, _, kept = _remove_folder(state.folder)
    if kept:
        logger.warning(
            f"SwapFolder.close: kept {state.folder}, which holds files not made by "
            f"deepspeed_cpp: {', '.join(kept[:5])}"
        )


# --- the folder -------------------------------------------------------------------------------


class SwapFolder:
    """A folder of swap files for one purpose of one rank of this run; see the module doc.

    ``write``, ``read``, ``remove``, ``wait_all`` and ``close`` are for one thread at a time;
    tickets may be waited for from any thread.
    """

    def __init__(
        self,
        nvme_path: str | os.PathLike,
        *,
        purpose: str,
        rank: int,
        aio: AioSettings = AioSettings(),
        max_in_flight: int = 4,
    ) -> None:
        if not isinstance(purpose, str) or not _PURPOSE.fullmatch(purpose):
            raise ValueError(
                f"SwapFolder: purpose must be letters, digits, '_', '.' and inner '-', got "
                f"{purpose!r}"
            )
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"SwapFolder: rank must be an int >= 0, got {rank!r}")
        if (
            isinstance(max_in_flight, bool)
            or not isinstance(max_in_flight, int)
            or max_in_flight < 1
        ):
            raise ValueError(
                f"SwapFolder: max_in_flight must be an int >= 1, got {max_in_flight!r}"
            )
        if not isinstance(aio, AioSettings):
            raise TypeError(f"SwapFolder: aio must be an AioSettings, got {type(aio).__name__}")
        nvme = Path(os.fspath(nvme_path))
        if not nvme.exists():
            raise SwapFileError(
                f"SwapFolder: nvme_path '{nvme}' does not exist: {errno_text(errno_module.ENOENT)}",
                errno=errno_module.ENOENT,
                path=nvme,
            )
        if not nvme.is_dir():
            raise SwapFileError(
                f"SwapFolder: nvme_path '{nvme}' is not a directory: "
                f"{errno_text(errno_module.ENOTDIR)}",
                errno=errno_module.ENOTDIR,
                path=nvme,
            )
        root = nvme / ROOT_NAME
        try:
            root.mkdir(exist_ok=True)
        except OSError as error:
            raise _os_error(
                f"SwapFolder: cannot make the swap root in nvme_path '{nvme}'", error, root
            ) from None
        remove_stale_folders(nvme)
        run_id = secrets.token_hex(_RUN_ID_HEX // 2)
        folder = root / f"{purpose}-{_host_name()}-pid{os.getpid()}-rank{rank}-{run_id}"
        try:
            folder.mkdir(mode=0o700)
            owner = {
                "pid": os.getpid(),
                "start_time": _process_start_time(os.getpid()),
                "host": socket.gethostname(),
                "run_id": run_id,
            }
            (folder / _OWNER_FILE).write_text(json.dumps(owner))
        except OSError as error:
            shutil.rmtree(folder, ignore_errors=True)
            raise _os_error(
                f"SwapFolder: cannot make a swap folder in nvme_path '{nvme}'", error, folder
            ) from None
        self.nvme_path = nvme
        self.folder = folder
        self.run_id = run_id
        self.purpose = purpose
        self.rank = rank
        self.aio = aio
        self.max_in_flight = max_in_flight
        self._state = _State(folder, run_id, aio, max_in_flight)
        self._finalizer = weakref.finalize(self, _close_state, self._state)

    # --- transfers ----------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        """The file that holds ``key``."""
        return self.folder / _file_name(key)

    def write(self, key: str, tensor: torch.Tensor) -> SwapTicket:
        """Starts writing ``tensor`` (a contiguous CPU tensor) under ``key``, replacing what was
        there. Keep the tensor unchanged until the ticket's ``wait()``. Raises `SwapFileError`
        at once when the file cannot be prepared; a failed data write is raised by the ticket
        (the key then has no data: ``has(key)`` is False)."""
        state = self._open_state("write")
        _check_key(key)
        flat = _flat_bytes(tensor, "write", "tensor")
        path = self.path_of(key)
        self._settle(key)
        with state.lock:
            state.generation += 1
            generation = state.generation
        dtype, numel, nbytes = tensor.dtype, tensor.numel(), flat.numel()
        header = _encode_header(state.run_id, key, dtype, numel, generation, complete=False)
        what = f"SwapFolder: preparing the write of key {key!r}"
        state.entries.pop(key, None)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                _pwrite_all(fd, header, 0)
                os.ftruncate(fd, HEADER_BYTES + nbytes)
            finally:
                os.close(fd)
        except OSError as error:
            raise _os_error(what, error, path, nbytes) from None
        complete = _encode_header(state.run_id, key, dtype, numel, generation, complete=True)
        entry = _Entry(dtype, numel, generation, path)
        state.entries[key] = entry

        def on_success():
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                _pwrite_all(fd, complete, 0)
            finally:
                os.close(fd)

        def on_failure():
            if state.entries.get(key) is entry:
                del state.entries[key]
            try:
                os.unlink(path)  # its data is incomplete: give the space back
            except OSError:
                pass

        ticket = SwapTicket("write", key, path, nbytes)
        self._submit(ticket, "async_pwrite", flat, on_success, on_failure)
        return ticket

    def read(self, key: str, into: torch.Tensor) -> SwapTicket:
        """Starts reading ``key`` into ``into`` (a contiguous CPU tensor of the dtype and
        element count that were written). Waits for an earlier transfer of the same key first.
        The header and the file size are checked before anything is read:
        `StaleSwapFileError` names the file and what does not match; a key never written (or
        removed, or whose write failed) is a `SwapFileError` (ENOENT)."""
        state = self._open_state("read")
        _check_key(key)
        flat = _flat_bytes(into, "read", "into")
        path = self.path_of(key)
        self._settle(key)
        entry = state.entries.get(key)
        if entry is None and path.exists():
            self._check_file(key, path, None, into)  # a file this SwapFolder did not write
        if entry is None:
            raise SwapFileError(
                f"SwapFolder.read: key {key!r} has no data in '{path}' (never written, removed, "
                f"or its last write failed): {errno_text(errno_module.ENOENT)}",
                errno=errno_module.ENOENT,
                path=path,
                nbytes=flat.numel(),
            )
        self._check_file(key, path, entry, into)
        ticket = SwapTicket("read", key, path, flat.numel())
        self._submit(ticket, "async_pread", flat, None, None)
        return ticket

    def has(self, key: str) -> bool:
        """Whether ``key`` holds data (its latest write is done, or in flight and not failed)."""
        return key in self._state.entries

    def keys(self) -> list[str]:
        """The keys that hold data (see `has`)."""
        return list(self._state.entries)

    def remove(self, key: str) -> None:
        """Deletes ``key``'s file (after its transfers in flight); a missing key is no error."""
        state = self._open_state("remove")
        self._settle(key)
        state.entries.pop(key, None)
        state.last.pop(key, None)
        path = self.path_of(key)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise _os_error(f"SwapFolder.remove: key {key!r}", error, path) from None

    def wait_all(self) -> None:
        """Waits for every transfer in flight; raises one `SwapFileError` for those that failed
        and whose ticket did not report it yet."""
        failed = self._state.wait_all()
        if len(failed) == 1:
            failed[0]._reported = True
            raise failed[0]._error
        if failed:
            for ticket in failed:
                ticket._reported = True
            first = failed[0]._error
            lines = "\n".join(f"  - {ticket._error}" for ticket in failed)
            raise SwapFileError(
                f"SwapFolder: {len(failed)} transfers failed:\n{lines}",
                errno=first.errno,
                path=first.filename,
                nbytes=first.nbytes,
            )

    def bytes_on_disk(self) -> int:
        """The size of this folder's swap files (headers included)."""
        total = 0
        try:
            for entry in os.scandir(self.folder):
                if entry.name.endswith(_SUFFIX):
                    total += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
        return total

    def in_flight(self) -> int:
        """Transfers submitted and not finished."""
        with self._state.lock:
            return len(self._state.in_flight)

    def close(self) -> None:
        """Waits for the transfers in flight, then deletes the files and the folder (files not
        made here are kept, with a warning). Idempotent."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def __enter__(self) -> SwapFolder:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SwapFolder('{self.folder}', {len(self._state.entries)} keys)"

    # --- internals ----------------------------------------------------------------------------
    def _open_state(self, method: str) -> _State:
        if self._state.closed:
            raise ValueError(f"SwapFolder.{method}: the folder {self.folder} is closed")
        return self._state

    def _settle(self, key: str) -> None:
        """Waits (without raising) for the latest transfer of ``key``."""
        previous = self._state.last.get(key)
        if previous is not None:
            previous._finished.wait()

    def _submit(
        self, ticket: SwapTicket, method: str, flat: torch.Tensor, on_success, on_failure
    ) -> None:
        state = self._state
        state.last[ticket.key] = ticket
        if flat.numel() == 0:  # nothing to move
            error = None
            if on_success is not None:
                try:
                    on_success()
                except OSError as failure:
                    error = _os_error(
                        f"SwapFolder: finishing the write of key {ticket.key!r}",
                        failure,
                        ticket.path,
                        0,
                    )
                    on_failure()
            ticket._finish(error)
            return
        slot = state.acquire()
        try:
            getattr(slot.handle, method)(flat, str(ticket.path), HEADER_BYTES)
        except BaseException as failure:
            state.release(slot, None)
            if on_failure is not None:
                on_failure()
            ticket._finish(
                SwapFileError(
                    f"SwapFolder: the {ticket.kind} of key {ticket.key!r} "
                    f"could not start: {failure}",
                    path=ticket.path,
                    nbytes=ticket.nbytes,
                )
            )
            raise
        with state.lock:
            state.in_flight.add(ticket)
        slot.jobs.put((slot, ticket, on_success, on_failure))

    def _check_file(self, key: str, path: Path, entry: _Entry | None, into: torch.Tensor) -> None:
        def stale(what: str) -> StaleSwapFileError:
            return StaleSwapFileError(
                f"SwapFolder.read: swap file '{path}' of key {key!r} cannot be read: {what}",
                errno=errno_module.ESTALE,
                path=path,
                nbytes=into.numel() * into.element_size(),
            )

        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                block = os.pread(fd, HEADER_BYTES, 0)  # the header page only, no read-ahead
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
        except OSError as error:
            nbytes = into.numel() * into.element_size()
            raise _os_error(f"SwapFolder.read: key {key!r}", error, path, nbytes) from None
        header = _decode_header(block)
        if isinstance(header, str):
            raise stale(header)
        if header.run_id != self.run_id:
            raise stale(f"it was written by run {header.run_id!r}, this run is {self.run_id!r}")
        if header.key != key:
            raise stale(f"it holds key {header.key!r}")
        if not header.complete:
            raise stale("its write did not complete (the header is marked incomplete)")
        if entry is None:
            raise stale("this SwapFolder has no completed write of the key")
        if header.generation != entry.generation:
            raise stale(f"it holds write #{header.generation}, expected #{entry.generation}")
        wanted = (_dtype_name(into.dtype), into.numel())
        if (header.dtype, header.numel) != wanted:
            raise stale(
                f"it holds {header.numel} x {header.dtype}, the tensor to read into is "
                f"{wanted[1]} x {wanted[0]}"
            )
        if size != HEADER_BYTES + header.nbytes:
            raise stale(
                f"the file has {size} bytes, expected {HEADER_BYTES + header.nbytes} "
                f"({HEADER_BYTES}-byte header + {header.nbytes} bytes of data)"
            )


def _check_key(key: Any) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"SwapFolder: key must be a non-empty str, got {key!r}")
    if len(key.encode()) > _MAX_KEY_BYTES:
        raise ValueError(
            f"SwapFolder: key is {len(key.encode())} bytes long, the most is {_MAX_KEY_BYTES}"
        )


def _flat_bytes(tensor: Any, method: str, name: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"SwapFolder.{method}: {name} must be a torch.Tensor, got {type(tensor).__name__}"
        )
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise ValueError(
            f"SwapFolder.{method}: {name} must be a dense CPU tensor, got "
            f"{tensor.device} {tensor.layout}"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"SwapFolder.{method}: {name} must be contiguous, got strides "
            f"{tensor.stride()} for shape {tuple(tensor.shape)}"
        )
    return tensor.reshape(-1).view(torch.uint8)


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
