"""The random-number generator states a rank saves and restores with its shard.

Saved: torch's CPU generator, the CUDA generator of the engine's device (where there is one),
Python's ``random`` and NumPy's global generator. All are stored as tensors and plain tuples,
so that the shard file loads with ``weights_only=True``.
"""

from __future__ import annotations

import random

import numpy
import torch


def capture_rng_states(device: torch.device) -> dict:
    """The states of every generator this rank's training may draw from."""
    kind, keys, position, has_gauss, cached_gaussian = numpy.random.get_state()
    states = {
        "torch_cpu": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), position, has_gauss, cached_gaussian),
        "cuda": None,
    }
    if device.type == "cuda" and torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def restore_rng_states(states: dict, device: torch.device) -> None:
    """Puts back what ``capture_rng_states`` returned (a CUDA state only onto a CUDA device)."""
    torch.set_rng_state(states["torch_cpu"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached_gaussian = states["numpy"]
    numpy.random.set_state((kind, keys.numpy(), position, has_gauss, cached_gaussian))
    if states.get("cuda") is not None and device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"], device)
