"""Reads slices of fp32 master buckets and optimizer state out of a checkpoint's shard files.

Each shard file is opened once, memory-mapped (``torch.load(mmap=True, weights_only=True)``), so
that reading the few slices a rank needs copies only those, whatever the file's size. Its SHA-256
is checked first, in one pass over the mapped pages (``digests.check_mapped_file``), so no
damaged byte reaches the unpickler or the model.

A shard file holds ``{"rank", "world_size", "rng", "buckets": {bucket: {"start", "size",
"master", "state"}}}``: for each bucket slice it holds, the fp32 master values and the optimizer
state of that slice (tensors shaped like the slice, or scalars such as Adam's ``step``).
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from .digests import check_mapped_file
from .errors import IncompleteCheckpointError, not_weights_only
from .layout import listed_file
from .mapped_pages import MappedFile
from .metadata import ShardSlice, ZeroLayout

MASTER = "master"
"""The key under which ``read`` finds the fp32 master values (others are optimizer state)."""


def load_mapped(path: Path, sha256: str | None, role: str = "checkpoint file") -> dict:
    """``torch.load`` of a checkpoint file: memory-mapped, on the CPU, plain data only, after
    checking that its SHA-256 is ``sha256`` (None: a checkpoint saved without digests)."""
    try:
        check_mapped_file(path, sha256, role)
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except IncompleteCheckpointError:
        raise  # a digest mismatch, already naming the file
    except FileNotFoundError as error:
        raise IncompleteCheckpointError(f"checkpoint file {path} is missing") from error
    except pickle.UnpicklingError as error:
        raise not_weights_only(path, role, error) from None
    except (RuntimeError, OSError, EOFError) as error:
        raise IncompleteCheckpointError(
            f"checkpoint file {path} cannot be read: {error}"
        ) from error


class ShardReader:
    """Random access to the bucket slices of one checkpoint, through its ``ZeroLayout``."""

    def __init__(
        self, directory: str | Path, layout: ZeroLayout | None, digests: dict[str, str | None]
    ):
        self.directory = Path(directory)
        self.layout = layout
        self.digests = digests
        self._files: dict[str, dict] = {}
        self._maps: dict[str, MappedFile] = {}

    def file(self, name: str) -> dict:
        """The loaded file ``name`` (checked against its digest when first opened)."""
        if name not in self._files:
            path = listed_file(self.directory, name, self.digests, "shard file")
            self._files[name] = load_mapped(path, self.digests.get(name), "shard file")
            self._maps[name] = MappedFile(path)
        return self._files[name]

    def entry(self, piece: ShardSlice, bucket: int) -> dict:
        """The saved ``{"start", "size", "master", "state"}`` of one slice of ``bucket``."""
        entry = self.file(piece.file)["buckets"].get(bucket)
        if entry is None or (entry["start"], entry["size"]) != (piece.start, piece.size):
            found = None if entry is None else (entry["start"], entry["size"])
            raise IncompleteCheckpointError(
                f"{self.directory / piece.file} should hold elements [{piece.start}, "
                f"{piece.start + piece.size}) of bucket {bucket} (checkpoint_meta.json); it "
                f"holds {found}"
            )
        return entry

    def _value(self, piece: ShardSlice, bucket: int, key: str):
        entry = self.entry(piece, bucket)
        if key == MASTER:
            return entry["master"]
        if key not in entry["state"]:
            raise IncompleteCheckpointError(
                f"{self.directory / piece.file} has no optimizer state '{key}' for bucket "
                f"{bucket}; it has {sorted(entry['state'])}"
            )
        return entry["state"][key]

    def dtype(self, key: str, bucket: int) -> torch.dtype:
        """The dtype ``key`` is stored in for ``bucket``."""
        return self._value(self.layout.buckets[bucket].slices[0], bucket, key).dtype

    def scalar(self, key: str, bucket: int):
        """A per-bucket value of the optimizer state (identical in every slice of the bucket)."""
        return self._value(self.layout.buckets[bucket].slices[0], bucket, key)

    def read(self, key: str, bucket: int, start: int, stop: int, out: torch.Tensor | None) -> None:
        """Copies elements ``[start, stop)`` of ``bucket``'s ``key`` into ``out`` and gives the
        mapped pages it copied from back (``mapped_pages.py``); ``out`` None: only checks that
        the files hold them all (a load checks everything before it writes anything)."""
        covered = 0
        for piece in self.layout.buckets[bucket].slices:
            low, high = max(start, piece.start), min(stop, piece.start + piece.size)
            if low < high:
                values = self._value(piece, bucket, key)
                if out is not None:
                    source = values[low - piece.start : high - piece.start]
                    out[low - start : high - start].copy_(source)
                    self._maps[piece.file].release(source)
                covered += high - low
        if covered != stop - start:
            raise IncompleteCheckpointError(
                f"elements [{start}, {stop}) of bucket {bucket} are not all in the shard files "
                f"of {self.directory} (found {covered} of {stop - start})"
            )

    def release_pages(self) -> None:
        """Gives back every page of the open files' maps (``mapped_pages.py``): they are read
        again from the page cache if needed."""
        for mapped in self._maps.values():
            mapped.release_all()

    def close(self) -> None:
        """Drops the memory maps."""
        self._files.clear()
        self._maps.clear()
