"""``deepspeed.checkpoint.utils``: ``clone_tensors_for_torch_save``, which accelerate calls on a
model's state dict before saving it (ZeRO stages 0-2), and DeepSpeed's checkpoint file names."""

from __future__ import annotations

import os

import torch

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item, device: torch.device = _CPU):
    """``item`` with every tensor in it (in dicts, lists and tuples, however nested) replaced by
    a detached copy of its own on ``device``.

    Why a copy: under ZeRO the parameters view slices of one flat bucket, and ``torch.save``
    writes a view's whole storage (safetensors refuses shared storage outright); a copy holds
    exactly its own elements. Tensors that are one object (tied weights) stay one object in the
    result, so the saving code still sees them as tied. Other values are returned as they are.
    """
    copies: dict[int, torch.Tensor] = {}

    def clone(value):
        if torch.is_tensor(value):
            if id(value) not in copies:
                copies[id(value)] = value.detach().to(device=device, copy=True)
            return copies[id(value)]
        if isinstance(value, dict):
            return type(value)((key, clone(entry)) for key, entry in value.items())
        if isinstance(value, list):
            return [clone(entry) for entry in value]
        if isinstance(value, tuple):
            return tuple(clone(entry) for entry in value)
        return value

    return clone(item)


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """DeepSpeed's model-states file of model-parallel rank ``mp_rank_str`` (e.g. ``"00"``)."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """DeepSpeed's ZeRO optimizer-states file of data-parallel rank ``dp_rank``."""
    return os.path.join(
        base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"
    )
