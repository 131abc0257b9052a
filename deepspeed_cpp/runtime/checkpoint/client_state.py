"""The ``client_state`` of a checkpoint: plain data by default, arbitrary objects by opt-in.

Checkpoints are downloaded and shared, so loading one must never run code: every file is
unpickled with ``weights_only=True``, which rebuilds tensors and plain data (numbers, strings,
lists, tuples, dicts, dtypes, devices...) and refuses any other class. A ``client_state`` that
holds other objects is therefore refused when *saving*, naming the key and the type, instead of
producing a checkpoint that cannot be loaded.

The opt-in, for callers who trust where their checkpoints go: ``save_checkpoint(...,
allow_pickle=True)`` stores such a client state; ``checkpoint_meta.json`` then records
``"client_state_needs_pickle": true``, and loading it requires ``load_checkpoint(...,
allow_pickle=True)`` — the one place in the package that unpickles in full
(``tests/test_unsafe_load_guard.py`` keeps it that way).
"""

from __future__ import annotations

import collections
import io
import pickle
from pathlib import Path

import torch

from .digests import read_checked_bytes
from .errors import IncompleteCheckpointError, PickleNotAllowedError, not_weights_only

NEEDS_PICKLE_KEY = "client_state_needs_pickle"
"""The metadata key recording that the client state needs ``allow_pickle=True`` to load."""

# Leaves weights_only=True rebuilds for certain; anything else is tried on its own (below).
_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
# Walked into; other dict types (defaultdict: refused by weights_only) are tried on their own.
_PLAIN_DICTS = (dict, collections.OrderedDict, collections.Counter)


def _first_non_plain(value, where: str):
    """``(where, value)`` of the first value in ``value`` that ``weights_only=True`` cannot
    rebuild, or None. Tensors are never serialised here: only leaves of unknown types are."""
    if isinstance(value, torch.Tensor) and type(value) in (torch.Tensor, torch.nn.Parameter):
        return None
    if isinstance(value, _PLAIN_LEAVES) and type(value) in _PLAIN_LEAVES:
        return None
    if type(value) in (list, tuple, torch.Size):
        for index, item in enumerate(value):
            found = _first_non_plain(item, f"{where}[{index}]")
            if found is not None:
                return found
        return None
    if type(value) in _PLAIN_DICTS:
        for key, item in value.items():
            found = _first_non_plain(key, f"a key of {where}")
            found = found or _first_non_plain(item, f"{where}[{key!r}]")
            if found is not None:
                return found
        return None
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - weights_only names the refused type in many ways
        return where, value
    return None


def check_client_state(client_state: dict, allow_pickle: bool) -> bool:
    """Whether ``client_state`` needs full unpickling to load. Without ``allow_pickle``, such a
    client state is refused with a ValueError naming the key and the type."""
    if not isinstance(client_state, dict):
        raise TypeError(
            f"save_checkpoint: client_state must be a dict, got a {type(client_state).__name__}"
        )
    found = _first_non_plain(client_state, "client_state")
    if found is None:
        return False
    if allow_pickle:
        return True
    where, value = found
    kind = type(value)
    raise ValueError(
        f"save_checkpoint: {where} is a {kind.__module__}.{kind.__qualname__}; a checkpoint's "
        f"client_state may hold tensors and plain data (numbers, strings, lists, tuples, dicts) "
        f"only, since loading never unpickles anything else (it could run code). Convert it "
        f"(e.g. to its state_dict()), or pass save_checkpoint(..., allow_pickle=True), after "
        f"which loading needs load_checkpoint(..., allow_pickle=True)"
    )


def load_client_state(
    path: Path, sha256: str | None, needs_pickle: bool, allow_pickle: bool
) -> dict:
    """Reads ``path`` (hashed as it is read) and unpickles its client state: with
    ``weights_only=True`` unless the checkpoint records that it needs more and the caller
    opted in with ``allow_pickle``."""
    if needs_pickle and not allow_pickle:
        raise PickleNotAllowedError(
            f"{path} holds objects other than tensors and plain data (the checkpoint was saved "
            f"with allow_pickle=True, checkpoint_meta.json: {NEEDS_PICKLE_KEY}); unpickling it "
            f"can run code, so it is loaded only with load_checkpoint(..., allow_pickle=True), "
            f"for checkpoints whose origin you trust"
        )
    try:
        data = read_checked_bytes(path, sha256, "client state")
    except FileNotFoundError as error:
        raise IncompleteCheckpointError(f"checkpoint file {path} is missing") from error
    if needs_pickle:
        # The opt-in path: the caller asked for it and the metadata declares it.
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)["client_state"]
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["client_state"]
    except pickle.UnpicklingError as error:
        # The metadata says plain data, the file says otherwise: never unpickled.
        raise not_weights_only(
            path, f"client state; {NEEDS_PICKLE_KEY} not recorded", error
        ) from None
    except Exception as error:  # noqa: BLE001 - a damaged archive fails in many ways
        raise IncompleteCheckpointError(
            f"checkpoint file {path} cannot be read: {error}"
        ) from error
