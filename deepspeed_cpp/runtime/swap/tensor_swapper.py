"""Swaps lists of tensors out to a folder and back in fixed-size chunks through two pinned buffers.

While one buffer's chunk is on its way to or from the disk, the caller's computation runs on the
other buffer's chunk, so I/O and computation overlap. Each buffer has its own aio handle, so that
waiting for one chunk never waits for the other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ...ops.aio import AsyncIOHandle

# Called with (index of the tensor in the list, element offset of the chunk in it, the chunk as a
# 1-D view of a pinned buffer with the tensor's dtype).
ChunkCallback = Callable[[int, int, torch.Tensor], None]

_ALIGNMENT = 4096  # O_DIRECT's alignment: chunk offsets in the files stay multiples of it


class TensorSwapper:
    """Writes tensors to one file each in a folder and reads them back, chunk by chunk.

    ``chunk_bytes`` (a multiple of 4096) is the size of each of the two pinned buffers, i.e. the
    most that is in flight or being computed on at once; the other arguments are the aio
    handle's (DeepSpeed's ``aio`` config section). Tensors must be contiguous CPU tensors.

    ``swap_out(tensors, folder, on_chunk)`` copies each chunk into a buffer, calls
    ``on_chunk(index, offset, chunk)`` on it (it may change the chunk: what it leaves there is
    written, the source tensor is not changed) and writes it while the next chunk is prepared.
    ``swap_in(tensors, folder, on_chunk)`` reads chunk k+1 while ``on_chunk`` runs on chunk k
    (changes it makes land in the tensor), then copies chunk k into the tensor.

    Files are named by position (``tensor_00000.swap``, ...), so ``swap_in`` takes tensors of
    the same sizes and dtypes, in the same order, as the ``swap_out`` that wrote the folder.
    A tensor with no elements is one empty chunk (the callback sees an empty view).
    """

    def __init__(
        self,
        chunk_bytes: int = 64 << 20,
        block_size: int = 1 << 20,
        queue_depth: int = 32,
        intra_op_parallelism: int = 1,
        single_submit: bool = False,
        overlap_events: bool = True,
        engine: str = "auto",
    ) -> None:
        if (
            isinstance(chunk_bytes, bool)
            or not isinstance(chunk_bytes, int)
            or chunk_bytes <= 0
            or chunk_bytes % _ALIGNMENT
        ):
            raise ValueError(
                f"TensorSwapper: chunk_bytes must be a positive multiple of {_ALIGNMENT}, got "
                f"{chunk_bytes!r}"
            )
        self.chunk_bytes = chunk_bytes
        self._handles = [
            AsyncIOHandle(
                block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism, engine
            )
            for _ in range(2)
        ]
        example = torch.empty(0, dtype=torch.uint8)
        self._buffers = [h.new_cpu_locked_tensor(chunk_bytes, example) for h in self._handles]

    @staticmethod
    def file_for(folder: str | os.PathLike, index: int) -> Path:
        """The file that holds tensor ``index`` of a swapped-out list."""
        return Path(folder) / f"tensor_{index:05d}.swap"

    def requests_in_flight(self) -> int:
        """Chunk transfers submitted and not yet waited for (for monitoring the overlap)."""
        return sum(handle.pending_requests() for handle in self._handles)

    def engine(self) -> str:
        """The I/O engine in use."""
        return self._handles[0].get_engine()

    def swap_out(
        self,
        tensors: Sequence[torch.Tensor],
        folder: str | os.PathLike,
        on_chunk: ChunkCallback | None = None,
    ) -> list[Path]:
        """Writes each tensor to its file in ``folder`` (created if needed); returns the files.

        Each file is replaced and ends up holding exactly the tensor's bytes.
        """
        flats = _checked_flat(tensors, "swap_out")
        os.makedirs(folder, exist_ok=True)
        paths = [self.file_for(folder, i) for i in range(len(flats))]
        for path, flat in zip(paths, flats):
            # The chunks are written without truncation, so that a file swapped out again
            # keeps its disk blocks (overwriting them is the fast case); cut it to size first.
            nbytes = flat.numel() * flat.element_size()
            if path.is_file() and path.stat().st_size > nbytes:
                os.truncate(path, nbytes)
        with _Drain(self._handles):
            for number, (index, start, count) in enumerate(self._chunks(flats)):
                handle, chunk = self._slot(number, flats[index], count)
                handle.wait()  # the write that used this buffer two chunks ago is done
                chunk.copy_(flats[index][start : start + count])
                if on_chunk is not None:
                    on_chunk(index, start, chunk)
                offset = start * flats[index].element_size()
                handle.async_pwrite(chunk, str(paths[index]), offset, truncate=False)
        return paths

    def swap_in(
        self,
        tensors: Sequence[torch.Tensor],
        folder: str | os.PathLike,
        on_chunk: ChunkCallback | None = None,
    ) -> None:
        """Reads each tensor's file in ``folder`` into it, in place.

        Raises ``FileNotFoundError`` or ``ValueError`` (naming the file, its size and the
        tensor's) when a file is missing or does not hold exactly the tensor's bytes.
        """
        flats = _checked_flat(tensors, "swap_in")
        for index, flat in enumerate(flats):
            path = self.file_for(folder, index)
            if not path.is_file():
                raise FileNotFoundError(f"TensorSwapper.swap_in: {path} (tensor {index}) is gone")
            size, expected = path.stat().st_size, flat.numel() * flat.element_size()
            if size != expected:
                raise ValueError(
                    f"TensorSwapper.swap_in: {path} has {size} bytes, but tensor {index} "
                    f"({flat.numel()} x {flat.dtype}) needs {expected}"
                )
        chunks = list(self._chunks(flats))
        with _Drain(self._handles):
            self._start_read(chunks, 0, flats, folder)
            for number, (index, start, count) in enumerate(chunks):
                # Chunk number+1 goes into the other buffer, whose chunk was consumed last round.
                self._start_read(chunks, number + 1, flats, folder)
                handle, chunk = self._slot(number, flats[index], count)
                handle.wait()
                if on_chunk is not None:
                    on_chunk(index, start, chunk)
                flats[index][start : start + count].copy_(chunk)

    def _start_read(self, chunks, number: int, flats, folder) -> None:
        if number >= len(chunks):
            return
        index, start, count = chunks[number]
        handle, chunk = self._slot(number, flats[index], count)
        offset = start * flats[index].element_size()
        handle.async_pread(chunk, str(self.file_for(folder, index)), offset)

    def _slot(self, number: int, flat: torch.Tensor, count: int):
        """The handle and the buffer of chunk ``number``, the buffer viewed as ``count`` elements
        of ``flat``'s dtype."""
        buffer = self._buffers[number % 2]
        return self._handles[number % 2], buffer[: count * flat.element_size()].view(flat.dtype)

    def _chunks(self, flats):
        """(tensor index, element offset, element count) of every chunk, in order."""
        for index, flat in enumerate(flats):
            per_chunk = self.chunk_bytes // flat.element_size()
            if flat.numel() == 0:
                yield index, 0, 0
            for start in range(0, flat.numel(), per_chunk):
                yield index, start, min(per_chunk, flat.numel() - start)


class _Drain:
    """Waits for every handle on the way out, so that no transfer outlives the call; an error
    from the body wins over one from the waits."""

    def __init__(self, handles):
        self._handles = handles

    def __enter__(self):
        return self

    def __exit__(self, error_type, error, traceback):
        first_failure = None
        for handle in self._handles:
            try:
                handle.wait()
            except RuntimeError as failure:
                first_failure = first_failure or failure
        if error is None and first_failure is not None:
            raise first_failure
        return False


def _checked_flat(tensors: Sequence[torch.Tensor], method: str) -> list[torch.Tensor]:
    flats = []
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"TensorSwapper.{method}: tensors[{index}] must be a torch.Tensor, got "
                f"{type(tensor).__name__}"
            )
        if tensor.device.type != "cpu":
            raise ValueError(
                f"TensorSwapper.{method}: tensors[{index}] must be a CPU tensor, got device "
                f"{tensor.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(
                f"TensorSwapper.{method}: tensors[{index}] must be contiguous, got strides "
                f"{tensor.stride()} for shape {tuple(tensor.shape)}"
            )
        flats.append(tensor.view(-1))
    return flats
