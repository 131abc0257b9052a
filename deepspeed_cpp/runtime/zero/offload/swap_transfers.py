"""The handles that move swap files' bytes: ``AioSettings`` (the ``aio`` config section), and a
pool of aio handles, each with a thread waiting for its transfer, so that ``SwapTicket``s
complete independently (a read never waits for an unrelated write)."""

from __future__ import annotations

import errno as errno_module
import os
import queue
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from ....utils.logging import logger
from .stale_swap_folders import remove_folder
from .swap_errors import SwapFileError, errno_text, os_error

_AIO_ERRNO = re.compile(r"errno (\d+)\)")


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

    def __init__(self, state: TransferState) -> None:
        self.handle = state.aio.new_handle()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=_slot_loop,
            args=(self.handle, self.jobs, state),
            daemon=True,
            name=f"deepspeed_cpp-swap-{state.folder.name[:40]}",
        )
        self.thread.start()


def _slot_loop(handle, jobs: queue.SimpleQueue, state: TransferState) -> None:
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
                error = os_error(
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
class KeyEntry:
    dtype: torch.dtype
    numel: int
    generation: int
    path: Path


class TransferState:
    """Everything a SwapFolder owns, without a reference back to it (the finalizer and the
    pool's threads hold this)."""

    def __init__(
        self, folder: Path, run_id: str, aio: AioSettings, max_in_flight: int, owner_lock: int
    ) -> None:
        self.folder = folder
        # The descriptor holding the folder's owner flock: other jobs' sweeps see the folder
        # as live until close_transfers (or the process's end) closes it.
        self.owner_lock = owner_lock
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
        self.entries: dict[str, KeyEntry] = {}  # keys whose latest write was submitted
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


def close_transfers(state: TransferState) -> None:
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
    try:
        files, _, kept = remove_folder(state.folder)
    finally:
        os.close(state.owner_lock)  # only now: the folder is gone, nothing left to sweep
    if kept:
        logger.warning(
            f"SwapFolder.close: kept {state.folder}, which holds files not made by "
            f"deepspeed_cpp: {', '.join(kept[:5])}"
        )
