"""SHA-256 digests of checkpoint files: computed while a file is written, checked while it is read.

``checkpoint_meta.json`` lists every file of a checkpoint with its size and its SHA-256, and holds
a digest of its own contents (``metadata_sha256``), so that one flipped byte anywhere — a shard,
the module states, the client state, the metadata itself — makes loading (and ``zero_to_fp32``)
fail naming the file and both digests, instead of training on damaged numbers.

Digests detect damage (a disk, a copy, a truncated download), not tampering: whoever can rewrite
a file can rewrite the metadata too. That a hostile checkpoint cannot run code is the separate
rule that every file is unpickled with ``weights_only=True`` (see ``client_state.py``).

No byte is hashed twice and no file is read twice to check it:

- writing: torch.save writes its zip archive sequentially through ``HashingWriter.write``
  (it never seeks back), so the digest of the stream is the digest of the file;
- reading a memory-mapped file (module states, shards): the file is mapped once more by us and
  hashed in one pass before ``torch.load(mmap=True)`` maps it; both maps share the page cache,
  so the bytes come off the disk once, and the tensors are views of the pages that were hashed;
- reading the client state: the file is read in chunks, each hashed as it arrives, and the
  bytes are unpickled from memory.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import BinaryIO

from ...utils.logging import logger
from .errors import IncompleteCheckpointError

DIGEST_KEY = "sha256"
"""The key of a file's digest in its ``files`` entry of ``checkpoint_meta.json``."""
METADATA_DIGEST_KEY = "metadata_sha256"
"""The key of the metadata's own digest (over the canonical JSON of everything else in it)."""
_CHUNK = 1 << 20
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


class HashingWriter:
    """A write-only file object that hashes what passes through it to ``handle``."""

    def __init__(self, handle: BinaryIO):
        self._handle = handle
        self._hash = hashlib.sha256()

    def write(self, data) -> int:
        self._handle.write(data)
        self._hash.update(data)
        return len(memoryview(data).cast("B"))

    def flush(self) -> None:
        self._handle.flush()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def mismatch_error(path: Path, role: str, expected: str, found: str) -> IncompleteCheckpointError:
    return IncompleteCheckpointError(
        f"checkpoint file {path} ({role}) is damaged: its SHA-256 is {found}, "
        f"checkpoint_meta.json records {expected} (written at save time)"
    )


def check_mapped_file(path: Path, expected: str | None, role: str = "checkpoint file") -> None:
    """Hashes ``path`` through a read-only memory map (one pass, see the module docstring) and
    raises IncompleteCheckpointError when the digest is not ``expected`` (None: not checked)."""
    if expected is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        size = os.fstat(handle.fileno()).st_size
        if size:  # an empty file cannot be mapped
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    for start in range(0, size, _CHUNK):
                        digest.update(view[start : start + _CHUNK])
                        if _DONTNEED is not None:
                            # Hashed pages leave this process's resident set (they stay in the
                            # page cache for the load's own map): hashing a large shard must
                            # not raise the load's memory high-water mark by its size.
                            mapped.madvise(_DONTNEED, start, min(_CHUNK, size - start))
                finally:
                    view.release()
    if digest.hexdigest() != expected:
        raise mismatch_error(path, role, expected, digest.hexdigest())


def read_checked_bytes(path: Path, expected: str | None, role: str) -> bytes:
    """The bytes of ``path``, hashed chunk by chunk as they are read; raises
    IncompleteCheckpointError when their digest is not ``expected`` (None: not checked)."""
    digest = hashlib.sha256()
    chunks = []
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            chunks.append(chunk)
    if expected is not None and digest.hexdigest() != expected:
        raise mismatch_error(path, role, expected, digest.hexdigest())
    return b"".join(chunks)


def _canonical_digest(metadata: dict) -> str:
    body = {k: v for k, v in metadata.items() if k != METADATA_DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def seal_metadata(metadata: dict) -> dict:
    """``metadata`` with its own digest added (the digest covers its canonical JSON, so the
    human-readable layout of the file does not matter)."""
    return {**metadata, METADATA_DIGEST_KEY: _canonical_digest(metadata)}


_warned_unchecked: set[str] = set()


def check_metadata(metadata: dict, path: Path) -> None:
    """Checks the metadata's own digest; a checkpoint saved before digests existed (no digest at
    all) loads with one warning per checkpoint and process."""
    expected = metadata.get(METADATA_DIGEST_KEY)
    if expected is None:
        key = str(path.parent.resolve())
        if key not in _warned_unchecked:
            _warned_unchecked.add(key)
            logger.warning(
                "deepspeed_cpp: checkpoint %s has no SHA-256 digests (saved by an older "
                "deepspeed_cpp): its files are loaded without an integrity check",
                path.parent,
            )
        return
    found = _canonical_digest(metadata)
    if found != expected:
        raise mismatch_error(path, "checkpoint metadata", expected, found)


def file_digests(metadata: dict) -> dict[str, str | None]:
    """File name -> its recorded SHA-256 (None for checkpoints saved without digests)."""
    return {entry["name"]: entry.get(DIGEST_KEY) for entry in metadata["files"]}
