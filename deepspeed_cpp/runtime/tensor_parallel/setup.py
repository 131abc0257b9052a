"""AutoTP training set-up: ``tp_model_init`` and what ``initialize()`` does with
``"tensor_parallel": {"autotp_size": N}``.

1. The TP × DP groups are built (``groups.py``) and passed to the engine as its ``mpu``: ZeRO
   runs over its data-parallel group, the gradient norm over the whole model
   (``runtime/model_parallel.py``). A caller's own ``mpu`` may be given instead: its
   model-parallel group is then the TP group.
2. Every rank starts from global rank 0's whole model (weights and buffers broadcast over the
   world), then each keeps its TP slices (``module_inject.shard_model``). A model split by
   ``tp_model_init`` before is taken as it is.
3. Parameters that were replaced by slices are replaced in the user's optimizer and
   ``model_parameters`` too, so an optimizer built before ``initialize()`` trains the slices.
4. The ranks of a TP group continue from one random state (the first rank's): dropout outside
   the split layers must drop the same elements on every TP rank, whose activations there are
   copies of one another.

DeepSpeed 0.19.8's ``tp_model_init`` only records its arguments and splits in ``initialize()``;
here it splits at once (as DeepSpeed 0.16 did), so that transformers' Trainer, which builds its
optimizer between the two calls, builds it over the slices. The result is the same model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ...module_inject import shard_model, tensor_parallel_info
from .groups import model_parallel_unit


def tp_model_init(model: torch.nn.Module, tp_size: int, dtype=None, config=None, **kwargs):
    """Splits ``model`` for tensor parallelism over groups of ``tp_size`` ranks (DeepSpeed's
    ``deepspeed.tp_model_init``, which transformers calls); returns it. ``dtype`` (if given)
    is the floating dtype the model is cast to first; ``config`` a DeepSpeed config dict whose
    ``tensor_parallel`` section, if any, must agree with ``tp_size``."""
    if kwargs.get("tp_group") is not None or kwargs.get("mpu") is not None:
        raise NotImplementedError(
            "tp_model_init(tp_group=... / mpu=...): the groups are built from tp_size"
        )
    section = (config or {}).get("tensor_parallel", {}) if isinstance(config, dict) else {}
    configured = section.get("autotp_size", 0) if isinstance(section, dict) else 0
    if configured not in (0, 1, tp_size):
        raise ValueError(
            f"tp_model_init(tp_size={tp_size}) but the config's tensor_parallel.autotp_size is "
            f"{configured}: expected the same size"
        )
    if dtype is not None:
        if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(f"tp_model_init(dtype={dtype!r}): expected a floating torch.dtype")
        model.to(dtype)
    if tp_size == 1:
        return model
    partition_config = section.get("partition_config") if isinstance(section, dict) else None
    preset = section.get("preset_model") if isinstance(section, dict) else None
    split_model(model, model_parallel_unit(tp_size), partition_config, preset)
    return model


def split_model(model, mpu, partition_config=None, preset=None) -> dict:
    """Broadcasts rank 0's whole model to every rank, then splits it over ``mpu``'s
    model-parallel (tensor-parallel) group; returns {id(replaced parameter): its slice}."""
    group = mpu.get_model_parallel_group()
    _broadcast_whole_model(model)
    _align_random_state(group)
    policy = None
    if preset is not None:
        from ...module_inject.tp_policies import policy_for_model_type

        policy = policy_for_model_type(preset)
    before = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    shard_model(model, group, policy=policy, partition_config=partition_config)
    after = dict(model.named_parameters(remove_duplicate=False))
    return {id(old): after[name] for name, old in before.items() if after.get(name) is not old}


def mpu_for(model, tp_size: int, mpu=None):
    """The mpu ``initialize()`` trains with: the caller's (its model-parallel group is the TP
    group; its size must be ``tp_size``), else the groups of the model's split (by
    ``tp_model_init``) or of ``tp_size``; None without tensor parallelism."""
    info = tensor_parallel_info(model)
    if info is not None and tp_size not in (0, 1, info.size):
        raise ValueError(
            f"the model was split by tp_model_init for tensor-parallel size {info.size} but "
            f"the config's tensor_parallel.autotp_size is {tp_size}: expected the same"
        )
    size = info.size if info is not None else tp_size
    if mpu is not None:
        if size > 1 and mpu.get_model_parallel_world_size() != size:
            raise ValueError(
                f"tensor_parallel.autotp_size is {size} but the mpu passed to initialize() has "
                f"model-parallel size {mpu.get_model_parallel_world_size()}: expected the same"
            )
        return mpu
    return model_parallel_unit(size) if size > 1 else None


def prepare_model(model, mpu, config) -> dict:
    """What the engine does first with a TP config (see the module docstring): splits ``model``
    over ``mpu`` unless ``tp_model_init`` did; returns {id(replaced parameter): its slice}."""
    if tensor_parallel_info(model) is not None:
        return {}
    section = config.tensor_parallel
    return split_model(model, mpu, section.partition_config, section.preset_model)


def remap_parameters(optimizer, model_parameters, replaced: dict):
    """The user's optimizer and ``model_parameters`` pointing at the slices that replaced their
    parameters (an optimizer built before ``initialize()`` saw the whole ones)."""
    if not replaced:
        return model_parameters

    def swap(params):
        return [replaced.get(id(p), p) for p in params]

    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError(
                "the optimizer passed to initialize() already has state for the whole "
                "parameters; tensor parallelism replaces them by slices: pass a fresh optimizer"
            )
        for group in optimizer.param_groups:
            group["params"] = swap(group["params"])
    if model_parameters is None:
        return None
    items = list(model_parameters)
    if items and isinstance(items[0], dict):
        return [dict(group, params=swap(group["params"])) for group in items]
    if items and isinstance(items[0], tuple):
        return [(name, replaced.get(id(p), p)) for name, p in items]
    return swap(items)


def _broadcast_whole_model(model: torch.nn.Module) -> None:
    if dist.get_world_size() == 1:
        return
    tensors = list(model.parameters()) + list(model.buffers())
    with torch.no_grad(), named_collective("broadcast of the whole model before its TP split"):
        for tensor in tensors:
            dist.broadcast(tensor.data, src=0)


def _align_random_state(group) -> None:
    if dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)
    state = torch.get_rng_state()
    with named_collective("broadcast of the random state inside the TP group"):
        dist.broadcast(state, src=source, group=group)
    torch.set_rng_state(state)
    from ...accelerator import get_accelerator

    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        device_state = accelerator.get_rng_state().to(accelerator.current_device_name())
        dist.broadcast(device_state, src=source, group=group)
        accelerator.set_rng_state(device_state.cpu())
