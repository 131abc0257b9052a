"""Reads a Weights & Biases run file (``wandb/offline-run-*/run-<id>.wandb``, what
``WANDB_MODE=offline`` leaves) back into its records, with wandb's own protobuf classes.

wandb no longer ships a Python reader of these files (its Go core writes and syncs them), so
the framing is read here: a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then LevelDB's
log format: 32 KiB blocks of chunks, each ``crc32 (4) | length (2) | type (1) | data``, type 1 a
whole record and 2/3/4 its first/middle/last part; a block's last < 7 bytes are padding.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

_BLOCK = 32 * 1024
_CHUNK_HEADER = struct.Struct("<IHB")
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def records(path: str | Path):
    """Every record of the file, as ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0), data[:7]
    position, pending = 7, b""
    while position + _CHUNK_HEADER.size <= len(data):
        left_in_block = _BLOCK - position % _BLOCK
        if left_in_block < _CHUNK_HEADER.size:
            position += left_in_block
            continue
        _, length, kind = _CHUNK_HEADER.unpack_from(data, position)
        if kind == 0:  # zeros: the end of what was written
            break
        start = position + _CHUNK_HEADER.size
        if start + length > len(data):  # a chunk still being written
            break
        pending += data[start : start + length]
        position = start + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wait_until_finished(path: str | Path, timeout: float = 60.0) -> None:
    """Waits for the run's ``exit`` record: wandb's core writes the file in its own process,
    and ``run.finish()`` can return before that process has flushed it."""
    deadline = time.monotonic() + timeout
    while not any(r.WhichOneof("record_type") == "exit" for r in records(path)):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: no exit record after {timeout:.0f} s")
        time.sleep(0.2)


def history(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """``{key: [(step, value), ...]}`` of the run's logged history (wandb's own ``_step``,
    ``_runtime`` and ``_timestamp`` left out)."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for record in records(path):
        if record.WhichOneof("record_type") != "history":
            continue
        for item in record.history.item:
            key = item.key or "/".join(item.nested_key)
            if not key.startswith("_"):
                curves.setdefault(key, []).append(
                    (record.history.step.num, json.loads(item.value_json))
                )
    return curves


def run_record(path: str | Path):
    """The run's ``RunRecord`` (project, group, entity, ...)."""
    for record in records(path):
        if record.WhichOneof("record_type") == "run":
            return record.run
    raise AssertionError(f"{path} holds no run record")
