"""``engine.save_16bit_model``: the model's weights, whole, in the dtype it trains in, one file.

DeepSpeed's behaviour, which this follows:

- ZeRO stages 0-2 keep every parameter whole on every rank: rank 0 writes the module's
  ``state_dict``;
- ZeRO-3 with ``zero_optimization.stage3_gather_16bit_weights_on_model_save: true``: the
  partitioned parameters are gathered one at a time and only rank 0 keeps them (the other ranks
  never hold more than the parameter being gathered), and rank 0 writes the result;
- ZeRO-3 with that key false (the default): nothing is written and every rank returns False
  with a warning, since each rank only has its shards (``zero_to_fp32`` consolidates a
  checkpoint instead).

Unlike DeepSpeed, the file is written atomically (temporary name, fsync, rename: a reader sees
the old file or the whole new one), and a file name ending in ``.safetensors`` is written as
safetensors. Tied parameters are one shared tensor under each of their names in a torch file;
safetensors cannot store aliases, so there each name gets its own copy (``load_file`` then
``load_state_dict`` works unchanged, at the price of the tied tensors' bytes once more).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ...utils.logging import logger
from .atomic_files import write_atomically, write_atomically_by_name
from .errors import CheckpointSaveError
from .rank_agreement import agree_on


def share_tied(module: torch.nn.Module, state_dict: dict) -> dict:
    """Makes every name of a tied parameter refer to one tensor (the first name's); under ZeRO-3
    each name was gathered and copied on its own."""
    first: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(param), name)
        if owner != name and owner in state_dict and name in state_dict:
            state_dict[name] = state_dict[owner]
    return state_dict


def compact(state_dict: dict) -> dict:
    """Each tensor in storage of its own size: the parameters of ZeRO buckets view one flat
    tensor, and torch.save writes a view's whole storage (safetensors refuses it). Tensors that
    are one object stay one (tied parameters)."""
    copies: dict[int, torch.Tensor] = {}
    result = {}
    for name, value in state_dict.items():
        if not torch.is_tensor(value):
            result[name] = value
            continue
        if id(value) not in copies:
            whole = value.untyped_storage().nbytes() == value.nbytes and value.is_contiguous()
            copies[id(value)] = value.detach() if whole else value.detach().clone()
        result[name] = copies[id(value)]
    return result


def _drop_frozen(subject, state_dict: dict) -> None:
    for name, param in subject.module.named_parameters(remove_duplicate=False):
        if not param.requires_grad:
            state_dict.pop(name, None)


def _write(state_dict: dict, path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.name.endswith(".safetensors"):
        from safetensors.torch import save_file

        tensors, seen = {}, set()
        for name, tensor in state_dict.items():
            if not torch.is_tensor(tensor):
                raise TypeError(
                    f"save_16bit_model: '{name}' is a {type(tensor).__name__}, and safetensors "
                    f"stores tensors only; use a torch file name (e.g. pytorch_model.bin)"
                )
            # safetensors refuses tensors sharing memory: a tied name gets its own copy.
            tensors[name] = tensor.clone() if id(tensor) in seen else tensor.contiguous()
            seen.add(id(tensor))
        return write_atomically_by_name(
            path, lambda temporary: save_file(tensors, str(temporary), metadata={"format": "pt"})
        )
    return write_atomically(path, lambda handle: torch.save(state_dict, handle))


def save_16bit_model(
    subject,
    save_dir,
    save_filename: str = "pytorch_model.bin",
    exclude_frozen_parameters: bool = False,
) -> bool:
    """Writes the whole model's state dict to ``save_dir/save_filename`` from rank 0 (see the
    module docstring); collective. Returns True when saved, False (every rank) when ZeRO-3 is
    not configured to gather the weights."""
    # A model split by AutoTP is gathered from its slices (subject.whole_model_state_dict).
    split_by_autotp = getattr(subject.module, "ds_autotp_parsed", False)
    if subject.mp_world_size > 1 and not split_by_autotp:
        raise NotImplementedError(
            f"save_16bit_model: the model is split over {subject.mp_world_size} model-parallel "
            "ranks (initialize(mpu=...)) and gathering the whole model from its parts is not "
            "supported yet; use save_checkpoint (one part per model-parallel rank)"
        )
    path = Path(save_dir) / save_filename
    if subject.zero_stage == 3 and not subject.gathers_16bit_weights_on_save:
        if subject.global_rank == 0:
            logger.warning(
                "deepspeed_cpp: did not save the model %s: under ZeRO-3 each rank holds only "
                "its shards and zero_optimization.stage3_gather_16bit_weights_on_model_save is "
                "false; set it to true, or save a checkpoint and consolidate it with "
                "deepspeed_cpp.utils.zero_to_fp32",
                path,
            )
        return False
    state: dict = {}

    def gather() -> None:
        # Collective under ZeRO-3; the other ranks get {} and keep nothing.
        state.update(subject.whole_model_state_dict(True))

    def write() -> int:
        if subject.global_rank != 0:
            return 0
        state_dict = share_tied(subject.module, state)
        if exclude_frozen_parameters:
            _drop_frozen(subject, state_dict)
        return _write(compact(state_dict), path)

    what = f"save_16bit_model {path}"
    agree_on(gather, group=subject.group, what=what, error_type=CheckpointSaveError)
    sizes = agree_on(write, group=subject.group, what=what, error_type=CheckpointSaveError)
    if subject.global_rank == 0:
        logger.info("deepspeed_cpp: saved the model to %s (%.1f MB)", path, sizes[0] / 1e6)
    return True
