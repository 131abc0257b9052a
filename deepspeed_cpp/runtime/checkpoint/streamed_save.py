"""``torch.save``'s file format, written with some tensors' bytes fetched only as they are written.

A shard file saved with NVMe offload names every optimizer-state tensor of the rank, but the
tensors live in swap files: copying them all out before ``torch.save`` would hold the rank's
whole state in host memory. Here each such tensor is a ``DeferredTensor``; it is pickled exactly
as ``torch.save`` pickles a contiguous CPU tensor of that dtype and size (``_rebuild_tensor_v2``
over a typed storage named by a persistent id), and its record is written from
``deferred.reader.view(deferred)``, which brings in one sub-group at a time.

The archive is the one ``torch.save`` writes (same records, in the same order, with the same
alignment and checksums); ``tests/test_streamed_save.py`` checks that the bytes are identical,
so a checkpoint loads, reshards and hashes the same whichever way it was saved.
"""

from __future__ import annotations

import collections
import contextlib
import io
import pickle
import sys
from pathlib import Path
from typing import BinaryIO

import torch
from torch.serialization import get_crc32_options, location_tag
from torch.utils.serialization import config as serialization_config

from ..zero.offload.deferred_tensor import DeferredTensor
from .atomic_files import write_atomically
from .digests import HashingWriter

_PICKLE_PROTOCOL = 2  # torch.save's default


class _DeferredStorage:
    """What a ``DeferredTensor`` pickles as its storage (one per tensor)."""

    def __init__(self, deferred: DeferredTensor) -> None:
        self.deferred = deferred


def _rebuild_args(deferred: DeferredTensor) -> tuple:
    # As Tensor.__reduce_ex__ for a contiguous 1-D tensor at offset 0 without grad or hooks;
    # fresh tuples as it makes them (a shared constant would be pickled as a memo reference).
    return (
        _DeferredStorage(deferred),
        0,
        (deferred.numel,),
        tuple([1]),
        False,
        collections.OrderedDict(),
    )


def _storage_type(dtype: torch.dtype):
    typed = torch.storage.TypedStorage(dtype=dtype, device="cpu", _internal=True)
    return getattr(torch, typed._pickle_storage_type())


class _Pickler(pickle.Pickler):
    """torch.save's pickler (same persistent ids, same key order) that also takes deferred
    tensors; ``records`` collects ``(key, storage or deferred)`` in the order torch.save writes
    them."""

    def __init__(self, handle) -> None:
        super().__init__(handle, protocol=_PICKLE_PROTOCOL)
        self.records: dict[str, object] = {}
        self._keys: dict[int, str] = {}
        self._kept: list = []  # keeps ids unique while pickling

    def reducer_override(self, obj):
        if isinstance(obj, DeferredTensor):
            if obj.dtype in torch.storage._new_dtypes():
                raise TypeError(f"a streamed checkpoint tensor cannot be {obj.dtype}")
            return torch._utils._rebuild_tensor_v2, _rebuild_args(obj)
        return NotImplemented

    def _key(self, identity: int, payload) -> str:
        key = self._keys.setdefault(identity, str(len(self._keys)))
        self.records[key] = payload
        return key

    def persistent_id(self, obj):
        if isinstance(obj, _DeferredStorage):
            self._kept.append(obj)
            deferred = obj.deferred
            key = self._key(id(obj), deferred)
            return ("storage", _storage_type(deferred.dtype), key, "cpu", deferred.numel)
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            key = self._key(storage._cdata, storage)
            storage_type = getattr(torch, obj._pickle_storage_type())
            return ("storage", storage_type, key, location_tag(storage), obj._size())
        if torch.is_storage(obj):
            key = self._key(obj._cdata, obj)
            return ("storage", torch.UntypedStorage, key, location_tag(obj), obj.nbytes())
        return None


def _write_archive(obj, handle: BinaryIO) -> None:
    pickler, data = _pickled(obj)
    writer = torch._C.PyTorchFileWriter(
        handle, get_crc32_options(), serialization_config.save.storage_alignment
    )
    readers = {id(p.reader): p.reader for p in pickler.records.values() if _is_deferred(p)}
    finished = False
    try:
        writer.write_record("data.pkl", data, len(data))
        writer.write_record(".format_version", "1", 1)
        alignment = str(serialization_config.save.storage_alignment)
        writer.write_record(".storage_alignment", alignment, len(alignment))
        writer.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        for key, payload in pickler.records.items():
            name = f"data/{key}"
            if _is_deferred(payload):
                nbytes = payload.nbytes
                writer.write_record(name, _own_storage(payload.reader.view(payload)), nbytes)
            else:
                nbytes = payload.nbytes()
                # As torch.save: a device storage is copied to the host for its record.
                host = payload if payload.device.type == "cpu" else payload.cpu()
                writer.write_record(name, host, nbytes)
        finished = True
        writer.write_end_of_file()
    finally:
        for reader in readers.values():
            reader.close()
        if not finished:
            # An unfinished writer would finish itself when collected, writing into a closed
            # file from a destructor (which aborts the process); the file is discarded anyway.
            with contextlib.suppress(Exception):
                writer.write_end_of_file()


def _own_storage(view: torch.Tensor) -> torch.UntypedStorage:
    """A storage spanning exactly ``view``'s bytes, sharing them (a swap buffer's view is part
    of a larger storage, and the writer writes a storage from its start)."""
    if not view.is_contiguous() or view.device.type != "cpu":
        raise RuntimeError(f"a streamed tensor must be contiguous on the CPU: {view.shape}")
    as_bytes = view.reshape(-1).view(torch.uint8).numpy()
    return torch.frombuffer(as_bytes, dtype=torch.uint8).untyped_storage()


def _is_deferred(payload) -> bool:
    return isinstance(payload, DeferredTensor)


def _pickled(obj) -> tuple[_Pickler, bytes]:
    buffer = io.BytesIO()
    pickler = _Pickler(buffer)
    pickler.dump(obj)
    return pickler, buffer.getvalue()


def save_streamed_atomically(obj, path: str | Path) -> tuple[int, str]:
    """``torch.save(obj)`` to ``path`` atomically, ``DeferredTensor`` entries included (see the
    module docstring); returns the file's size and its SHA-256, hashed while written."""
    writers: list[HashingWriter] = []

    def write(handle: BinaryIO) -> None:
        writers.append(HashingWriter(handle))
        _write_archive(obj, writers[-1])

    size = write_atomically(path, write)
    return size, writers[-1].hexdigest()
