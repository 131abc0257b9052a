"""Python entry points of csrc/aio: the asynchronous file I/O handle.

``AsyncIOHandle`` (also spelled ``aio_handle``, DeepSpeed's name) moves tensor bytes to and from
files with O_DIRECT through io_uring, libaio or a pread/pwrite thread pool::

    handle = AsyncIOHandle(block_size=1 << 20, queue_depth=32)
    buffer = handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.float32))
    handle.async_pwrite(buffer, "/nvme/x.swp")
    ...                     # other work while the write runs
    handle.wait()           # raises, naming file, offset, bytes and OS error, if anything failed
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from .op_builder import AsyncIOBuilder
from .op_loader import OpLoader

ENGINES = ("io_uring", "libaio", "threads")

_op = OpLoader(AsyncIOBuilder())


def load_aio() -> None:
    """Loads the op library (pre-built or JIT)."""
    _op.load()


def _library() -> ctypes.CDLL:
    load_aio()
    library = _op.builder.c_library()
    for name in ("deepspeed_cpp_aio_default_engine", "deepspeed_cpp_aio_compiled_engines"):
        getattr(library, name).restype = ctypes.c_char_p
    library.deepspeed_cpp_aio_engine_unavailable_reason.restype = ctypes.c_char_p
    library.deepspeed_cpp_aio_engine_unavailable_reason.argtypes = [ctypes.c_char_p]
    return library


def default_engine() -> str:
    """The engine a handle made with ``engine="auto"`` uses in this process.

    The best one that is compiled in and that the kernel allows (io_uring, then libaio, then the
    pread/pwrite thread pool), or the one named by the environment variable ``DS_AIO_ENGINE``.
    """
    return _library().deepspeed_cpp_aio_default_engine().decode()


def compiled_engines() -> list[str]:
    """The engines compiled into the loaded library, best first."""
    return _library().deepspeed_cpp_aio_compiled_engines().decode().split(",")


def engine_unavailable_reason(engine: str) -> str:
    """Empty when ``engine`` can run here, otherwise why not (not compiled in, kernel refuses)."""
    return _library().deepspeed_cpp_aio_engine_unavailable_reason(engine.encode()).decode()


def usable_engines() -> list[str]:
    """The engines a handle can be made with on this machine."""
    return [engine for engine in ENGINES if not engine_unavailable_reason(engine)]


def _filename(filename: Any, method: str) -> str:
    try:
        path = os.fspath(filename)
    except TypeError:
        raise TypeError(
            f"AsyncIOHandle.{method}: filename must be a str or os.PathLike, got "
            f"{type(filename).__name__}"
        ) from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    return path


class AsyncIOHandle:
    """Asynchronous reads and writes of whole tensors from and to files.

    The arguments are DeepSpeed's ``aio_handle``'s: requests are cut into ``block_size`` pieces
    (a multiple of 4096) kept ``queue_depth`` deep per worker, over ``intra_op_parallelism``
    worker threads; ``single_submit`` hands each piece to the kernel on its own instead of in
    batches; ``overlap_events`` refills the queue on every completion instead of per batch.
    ``engine`` picks the kernel interface: ``"auto"`` (see `default_engine`), ``"io_uring"``,
    ``"libaio"`` or ``"threads"`` (a pool of ``queue_depth`` pread/pwrite threads per worker).

    Semantics:

    - Files are opened with O_DIRECT. A tensor whose memory is not page-aligned goes through
      aligned bounce buffers; bytes of a request outside whole pages of the file (an unaligned
      offset, a size that is not a multiple of 4096) go through the page cache. On file systems
      that refuse O_DIRECT (ramfs, old tmpfs) everything goes through the page cache, with one
      warning per handle.
    - A write at ``file_offset=0`` replaces the file: it ends where the write ends (unless
      ``truncate=False``). A write at another offset changes only those bytes (and extends the
      file if it ends beyond it). Submit the offset-0 write of a file before writes at other
      offsets of it. Overwriting a file of the same size reuses its disk blocks (fastest).
    - Reading past the end of a file is an error.
    - ``wait()`` returns the number of requests submitted since the last ``wait()``; if any
      failed it raises one ``RuntimeError`` naming, for each failed request, the file, the offset,
      the byte count and the OS error. The handle stays usable.
    - The handle keeps each tensor's memory alive, and its storage from being resized, until the
      ``wait()`` that covers it.
    - Submission and ``wait()`` are for one thread at a time.
    """

    def __init__(
        self,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        single_submit: bool = False,
        overlap_events: bool = True,
        intra_op_parallelism: int = 1,
        engine: str = "auto",
    ) -> None:
        load_aio()
        for name, value in (
            ("block_size", block_size),
            ("queue_depth", queue_depth),
            ("intra_op_parallelism", intra_op_parallelism),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"AsyncIOHandle: {name} must be an int, got {value!r}")
        if engine not in ("auto", *ENGINES):
            raise ValueError(
                f"AsyncIOHandle: engine={engine!r} is not known; expected one of "
                f"auto, {', '.join(ENGINES)}"
            )
        self._handle = torch.classes.deepspeed_cpp.AsyncIOHandle(
            block_size,
            queue_depth,
            bool(single_submit),
            bool(overlap_events),
            intra_op_parallelism,
            engine,
        )
        # Requests to verify at the next wait(): (tensor, filename, file_offset).
        self._to_validate: list[tuple[torch.Tensor, str, int]] = []

    # --- DeepSpeed's asynchronous and synchronous calls ----------------------------------------
    def async_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        """Starts reading ``buffer.nbytes`` bytes of ``filename`` at ``file_offset`` into
        ``buffer``; returns 0. ``wait()`` completes it."""
        return self._handle.async_pread(buffer, _filename(filename, "async_pread"), file_offset)

    def async_pwrite(
        self, buffer: torch.Tensor, filename, file_offset: int = 0, truncate: bool = True
    ) -> int:
        """Starts writing ``buffer``'s bytes to ``filename`` at ``file_offset``; returns 0.
        ``wait()`` completes it. With ``truncate=False`` a write at offset 0 keeps a longer
        file's length instead of replacing the file (for writing a file in parts)."""
        path = _filename(filename, "async_pwrite")
        return self._handle.async_pwrite(buffer, path, file_offset, bool(truncate))

    def sync_pread(self, buffer: torch.Tensor, filename, file_offset: int = 0) -> int:
        """Reads and waits; returns the number of requests completed (with any pending ones)."""
        self.async_pread(buffer, filename, file_offset)
        return self.wait()

    def sync_pwrite(
        self, buffer: torch.Tensor, filename, file_offset: int = 0, truncate: bool = True
    ) -> int:
        """Writes and waits; returns the number of requests completed (with any pending ones)."""
        self.async_pwrite(buffer, filename, file_offset, truncate)
        return self.wait()

    def pread(self, buffer, filename, validate: bool, async_op: bool, file_offset: int = 0) -> int:
        """DeepSpeed's ``pread(buffer, filename, validate, async)``: asynchronous when
        ``async_op`` (returns 0), else synchronous (returns the completed count). ``validate``
        compares the tensor with the file through the page cache when the request completes."""
        self.async_pread(buffer, filename, file_offset)
        return self._finish(buffer, filename, file_offset, validate, async_op)

    def pwrite(self, buffer, filename, validate: bool, async_op: bool, file_offset: int = 0) -> int:
        """DeepSpeed's ``pwrite(buffer, filename, validate, async)``; see `pread`."""
        self.async_pwrite(buffer, filename, file_offset)
        return self._finish(buffer, filename, file_offset, validate, async_op)

    def read(self, buffer, filename, validate: bool, file_offset: int = 0) -> int:
        """DeepSpeed's synchronous ``read``; see `pread`."""
        return self.pread(buffer, filename, validate, False, file_offset)

    def write(self, buffer, filename, validate: bool, file_offset: int = 0) -> int:
        """DeepSpeed's synchronous ``write``; see `pread`."""
        return self.pwrite(buffer, filename, validate, False, file_offset)

    def wait(self) -> int:
        """Blocks until every submitted request finished; returns how many there were.

        Raises ``RuntimeError`` listing every failed request (file, offset, bytes, OS error),
        or a validation mismatch; the handle is ready for new requests either way.
        """
        to_validate, self._to_validate = self._to_validate, []
        completed = self._handle.wait()
        for tensor, filename, file_offset in to_validate:
            _validate(tensor, filename, file_offset)
        return completed

    def pending_requests(self) -> int:
        """Requests submitted since the last ``wait()`` (finished or not)."""
        return self._handle.pending_requests()

    # --- pinned buffers ------------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor) -> torch.Tensor:
        """A 1-D CPU tensor of ``num_elem`` elements of ``example_tensor``'s dtype, page-aligned
        (no bounce buffer needed) and locked in memory: pinned by CUDA when a GPU is present,
        else locked with mlock where the memory-lock limit allows."""
        return self._handle.new_cpu_locked_tensor(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, tensor: torch.Tensor) -> bool:
        """Detaches ``tensor`` (made by this handle) from its memory, which is released when no
        other view of it is left; returns False for a tensor this handle did not make."""
        return self._handle.free_cpu_locked_tensor(tensor)

    # --- settings and state --------------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._handle.get_block_size()

    def get_queue_depth(self) -> int:
        return self._handle.get_queue_depth()

    def get_single_submit(self) -> bool:
        return self._handle.get_single_submit()

    def get_overlap_events(self) -> bool:
        return self._handle.get_overlap_events()

    def get_intra_op_parallelism(self) -> int:
        return self._handle.get_intra_op_parallelism()

    get_thread_count = get_intra_op_parallelism  # DeepSpeed's older name

    def get_engine(self) -> str:
        """The engine this handle runs on: io_uring, libaio or threads."""
        return self._handle.get_engine()

    def get_stats(self) -> dict[str, int]:
        """Bytes moved so far: ``direct_bytes`` (O_DIRECT), ``buffered_bytes`` (page cache) and
        ``bounced_bytes`` (the part of direct_bytes that went through a bounce buffer)."""
        return dict(self._handle.get_stats())

    def _finish(self, buffer, filename, file_offset: int, validate: bool, async_op: bool) -> int:
        if validate:
            self._to_validate.append((buffer, _filename(filename, "validate"), file_offset))
        return 0 if async_op else self.wait()


aio_handle = AsyncIOHandle


def _validate(tensor: torch.Tensor, filename: str, file_offset: int) -> None:
    # Copied into default strides: a one-element view may keep another stride, which
    # view(torch.uint8) refuses for dtypes wider than a byte.
    dense = torch.empty(tensor.shape, dtype=tensor.dtype).copy_(tensor)
    expected = dense.view(-1).view(torch.uint8).numpy().tobytes()
    with open(filename, "rb") as file:
        file.seek(file_offset)
        found = file.read(len(expected))
    if found != expected:
        mismatch = next(
            (i for i, (a, b) in enumerate(zip(found, expected)) if a != b),
            min(len(found), len(expected)),
        )
        raise RuntimeError(
            f"AsyncIOHandle validation: '{filename}' at file offset {file_offset} differs from the "
            f"tensor ({len(expected)} bytes) first at byte {mismatch}"
        )
