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
process's pid and start time), whose ``flock`` the folder's ``SwapFolder`` holds while it lives.
Each swap file is a 4096-byte header followed by the tensor's bytes, so the data sits at a
4096-aligned offset and moves with O_DIRECT.

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
this host, whose owner lock nobody holds (see ``stale_swap_folders``). ``close()`` removes this
run's files and folder; it also runs when the object is garbage-collected and at interpreter
exit (never in a forked child).
"""

from __future__ import annotations

import errno as errno_module
import os
import re
import secrets
import socket
import weakref
from pathlib import Path
from typing import Any

import torch

from .stale_swap_folders import (
    PURPOSE,
    ROOT_NAME,
    RUN_ID_HEX,
    host_name,
    make_owned_folder,
    process_start_time,
    remove_stale_folders,
)
from .swap_errors import StaleSwapFileError, SwapFileError, errno_text, os_error
from .swap_header import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    SUFFIX,
    decode_header,
    dtype_name,
    encode_header,
    file_name,
)
from .swap_transfers import AioSettings, KeyEntry, SwapTicket, TransferState, close_transfers

_AIO_ERRNO = re.compile(r"errno (\d+)\)")

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
        aio: AioSettings | None = None,
        max_in_flight: int = 4,
    ) -> None:
        if not isinstance(purpose, str) or not PURPOSE.fullmatch(purpose):
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
        aio = AioSettings() if aio is None else aio
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
            raise os_error(
                f"SwapFolder: cannot make the swap root in nvme_path '{nvme}'", error, root
            ) from None
        remove_stale_folders(nvme)
        run_id = secrets.token_hex(RUN_ID_HEX // 2)
        name = f"{purpose}-{host_name()}-pid{os.getpid()}-rank{rank}-{run_id}"
        owner = {
            "pid": os.getpid(),
            "start_time": process_start_time(os.getpid()),
            "host": socket.gethostname(),
            "run_id": run_id,
        }
        try:
            folder, owner_lock = make_owned_folder(root, name, owner)
        except OSError as error:
            raise os_error(
                f"SwapFolder: cannot make a swap folder in nvme_path '{nvme}'", error, root / name
            ) from None
        self.nvme_path = nvme
        self.folder = folder
        self.run_id = run_id
        self.purpose = purpose
        self.rank = rank
        self.aio = aio
        self.max_in_flight = max_in_flight
        self._state = TransferState(folder, run_id, aio, max_in_flight, owner_lock)
        self._finalizer = weakref.finalize(self, close_transfers, self._state)

    # --- transfers ----------------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        """The file that holds ``key``."""
        return self.folder / file_name(key)

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
        header = encode_header(state.run_id, key, dtype, numel, generation, complete=False)
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
            raise os_error(what, error, path, nbytes) from None
        complete = encode_header(state.run_id, key, dtype, numel, generation, complete=True)
        entry = KeyEntry(dtype, numel, generation, path)
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
            raise os_error(f"SwapFolder.remove: key {key!r}", error, path) from None

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
                if entry.name.endswith(SUFFIX):
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
    def _open_state(self, method: str) -> TransferState:
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
                    error = os_error(
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

    def _check_file(self, key: str, path: Path, entry: KeyEntry | None, into: torch.Tensor) -> None:
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
            raise os_error(f"SwapFolder.read: key {key!r}", error, path, nbytes) from None
        header = decode_header(block)
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
        wanted = (dtype_name(into.dtype), into.numel())
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
    if len(key.encode()) > MAX_KEY_BYTES:
        raise ValueError(
            f"SwapFolder: key is {len(key.encode())} bytes long, the most is {MAX_KEY_BYTES}"
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
