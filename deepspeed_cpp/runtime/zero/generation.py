"""DeepSpeed's ``unwrap_model_for_generation``: a ZeRO-3 engine's module with every parameter
gathered for the duration of a ``with`` block, so that ``generate()`` runs its many small
forwards without a gather per layer per token (trl and OpenRLHF use it)."""

from __future__ import annotations

import contextlib

from .partition_parameters import GatheredParameters


@contextlib.contextmanager
def unwrap_model_for_generation(model):
    """Yields ``model`` (an engine) with all its parameters gathered (ZeRO-3; other stages hold
    them whole already), released again at the end of the block. Read-only: changes to the
    gathered weights are not written back.

    As DeepSpeed, ZeRO-3's gathering hooks are removed inside the block (a forward there runs
    on the gathered weights without a gather or a release per module) and installed again
    after it."""
    coordinator = getattr(getattr(model, "_zero_stage", None), "coordinator", None)
    if coordinator is None:
        with GatheredParameters(list(model.parameters())):
            yield model
        return
    # Removed before the gather: removing ends a pass still open, releasing what it holds.
    coordinator.remove_forward_hooks()
    try:
        with GatheredParameters(list(model.parameters())):
            yield model
    finally:
        coordinator.install_forward_hooks()
