"""The 4096-byte header in front of every swap file's data (see ``swap_files``): run, key, dtype,
element count, a per-key generation, whether the data behind it is complete, and a CRC."""

from __future__ import annotations

import struct
import urllib.parse
import zlib
from dataclasses import dataclass

import torch

HEADER_BYTES = 4096
FORMAT_VERSION = 1
SUFFIX = ".swp"
_MAGIC = b"DSCPPSWP"
# magic, version, complete, generation, run_id, dtype, numel, nbytes, key length, crc32
_HEADER = struct.Struct("<8sIIQ32s16sQQII")
_KEY_OFFSET = 128
MAX_KEY_BYTES = HEADER_BYTES - _KEY_OFFSET


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_header(
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
        dtype_name(dtype).encode(),
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


def decode_header(block: bytes) -> _Header | str:
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


def file_name(key: str) -> str:
    name = urllib.parse.quote(key, safe="")
    if name.startswith("."):
        name = "%2E" + name[1:]
    if len(name) > 200:
        import hashlib

        name = name[:120] + "~" + hashlib.sha256(key.encode()).hexdigest()
    return name + SUFFIX
