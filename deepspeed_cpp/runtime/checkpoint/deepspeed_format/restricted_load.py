"""Reads DeepSpeed's checkpoint files without running code from them.

DeepSpeed writes its ``*.pt`` files with ``torch.save`` of dicts that hold, besides tensors and
plain data, a few of its own objects. They are read with ``torch.load(weights_only=True)``,
which rebuilds tensors, storages, ``torch.Size``, dtypes, ``OrderedDict`` and plain data (torch's
own allow-list), plus exactly these DeepSpeed classes, each rebuilt as an inert stand-in defined
here (plain attributes, no behaviour; DeepSpeed need not be installed):

- ``deepspeed.runtime.fp16.loss_scaler.LossScaler``        (ZeRO 1/2/3 optimizer states)
- ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler`` (the same, with fp16)
- ``deepspeed.runtime.zero.config.ZeroStageEnum``          (the saved ZeRO stage: an int)
- ``deepspeed.utils.tensor_fragment.fragment_address``     (``param_slice_mappings``)

Any other class or function a file names is refused, naming it, before anything is built
(``UnsafeCheckpointError``): such a file was not written by DeepSpeed, or was tampered with.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from ..errors import IncompleteCheckpointError, UnsafeCheckpointError


class _PlainRecord:
    """An object rebuilt from its saved attributes only."""

    def __setstate__(self, state) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class LossScalerRecord(_PlainRecord):
    """DeepSpeed's (static or dynamic) loss scaler: ``cur_scale`` and its settings."""


class FragmentAddressRecord(_PlainRecord):
    """Where a parameter's fragment lies in a rank's flat partition: ``start``, ``numel``."""


class ZeroStageRecord(int):
    """DeepSpeed's ``ZeroStageEnum`` member, rebuilt as its stage number."""


ADMITTED = {
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScalerRecord,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": LossScalerRecord,
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageRecord,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddressRecord,
}

_REFUSED_GLOBAL = re.compile(r"GLOBAL ([A-Za-z_][\w.]*)")


def load_deepspeed_file(path: Path, allow_symlinks: bool = False) -> dict:
    """The dict a DeepSpeed checkpoint file holds, on the CPU, read as the module docstring
    says; UnsafeCheckpointError naming any other class the file names."""
    if not allow_symlinks and path.is_symlink():
        raise UnsafeCheckpointError(
            f"{path} (DeepSpeed checkpoint file) is a symbolic link; loading follows none: pass "
            "allow_symlinks=True if you made it and trust where it points"
        )
    stand_ins = [(cls, name) for name, cls in ADMITTED.items()]
    try:
        with torch.serialization.safe_globals(stand_ins):
            loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except FileNotFoundError as error:
        raise IncompleteCheckpointError(f"DeepSpeed checkpoint file {path} is missing") from error
    except pickle.UnpicklingError as error:
        # torch's own text is left out: it advises weights_only=False, which would run the code.
        refused = _REFUSED_GLOBAL.search(str(error))
        what = refused.group(1) if refused else "an object that is not plain data"
        raise UnsafeCheckpointError(
            f"DeepSpeed checkpoint file {path} names {what}, which is not among the classes "
            f"DeepSpeed's checkpoints hold ({', '.join(sorted(ADMITTED))}, and torch's tensors "
            "and plain data); it was refused unread: unpickling it could run code from the file"
        ) from None
    except (RuntimeError, OSError, EOFError) as error:
        raise IncompleteCheckpointError(
            f"DeepSpeed checkpoint file {path} cannot be read: {error}"
        ) from error
    if not isinstance(loaded, dict):
        raise IncompleteCheckpointError(
            f"DeepSpeed checkpoint file {path} holds a {type(loaded).__name__}, not a dict"
        )
    return loaded
