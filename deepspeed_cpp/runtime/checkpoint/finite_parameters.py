"""save_checkpoint refuses parameters that hold NaN or inf.

A checkpoint is what training resumes from and what ``latest`` points at: publishing weights
that are not finite would replace the last good one with one that cannot train. The module state
the save writes is checked where it is whole (rank 0 after the gather, or each rank's own with
expert-parallel layers), one pass over the parameters, before any file is written; the check is
one step of the save's rank agreement, so every rank raises and ``latest`` stays where it was.
"""

from __future__ import annotations

import torch

from .errors import CheckpointSaveError


class NonFiniteParametersError(CheckpointSaveError):
    """A parameter to be saved holds NaN or inf; nothing was published."""


def refuse_nonfinite_parameters(module: torch.nn.Module, state_dict: dict) -> None:
    """Raises NonFiniteParametersError naming the first parameter of ``module`` whose entry in
    ``state_dict`` (a module state about to be saved, possibly empty on this rank) holds a
    value that is not finite."""
    for name, _ in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(name)
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            continue
        finite = torch.isfinite(value)
        if not bool(finite.all()):
            bad = int(finite.numel() - finite.sum())
            raise NonFiniteParametersError(
                f"parameter '{name}' (shape {list(value.shape)}, {value.dtype}) holds {bad} "
                f"value(s) that are not finite (NaN or inf); a checkpoint of it would not train, "
                f"so it was not saved"
            )
