"""DeepSpeed's ZeRO tensor-fragment API: read and edit the fp32 master weight, the optimizer
state and the reduced gradient of one model parameter, whatever ZeRO stage (0-3) splits them
across the ranks, with or without optimizer offload.

- ``safe_get_full_*`` are collective over the parameter's data-parallel group (every rank calls,
  in the same order) and return the whole tensor, fp32, in the parameter's shape, on the
  engine's device. ``safe_set_full_*`` take the whole new value (the same on every rank) and are
  local: each rank writes its own part; ``safe_set_full_fp32_param`` also writes the
  low-precision copy the model computes with, so the next forward sees the new weights.
- ``safe_get_local_*`` / ``safe_set_local_*`` are this rank's part only (no communication), a
  1-D fp32 tensor: at ZeRO-3 a partitioned parameter's whole shard, padding included (as
  DeepSpeed); elsewhere (stages 0-2, ZeRO-3 persistent parameters; DeepSpeed refuses these) the
  run of the parameter's flattened elements this rank owns, possibly empty. Concatenated over the
  ranks in rank order and cut to the parameter's size, the local parts are the full tensor.
  ``safe_set_local_fp32_param`` of a ZeRO-3 partitioned parameter rewrites its shard; of a
  replicated one, this rank's copy of its part (the other ranks' copies follow at the next step).
- Gradients (``*_grad``) are the reduced ones: summed over the ranks and averaged, divided by
  the gradient-accumulation steps, before clipping, fp16 loss scale removed; they exist between
  the backward of an accumulation boundary and ``engine.step()``; elsewhere (mid-accumulation,
  after the step) reading one raises ``GradientNotAvailableError`` (a ValueError, as DeepSpeed).
  Inside ``engine.no_sync()`` (stages 0/1) ``safe_get_full_grad`` is local: this rank's own
  gradient accumulated since the last step (divided by the accumulation steps, loss scale
  removed), as no reduced one exists until a backward after the block.
- Optimizer state keys are the optimizer's per-element entries (Adam: ``exp_avg``,
  ``exp_avg_sq``), present from the first step on.
- A frozen parameter (``requires_grad=False``, no master or state) reads as None, as in DeepSpeed;
  a trainable one that no live engine's optimizer trains raises ``UnmanagedParameterError``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

__all__ = [
    "GradientNotAvailableError",
    "UnmanagedParameterError",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
]


class UnmanagedParameterError(ValueError):
    """The parameter is not trained by the optimizer of a live deepspeed_cpp engine."""


class GradientNotAvailableError(ValueError):
    """The reduced gradient is read outside the window in which it exists: after the backward
    of an accumulation boundary and before ``engine.step()`` (a ValueError, as DeepSpeed's)."""


# --- fp32 master weights -----------------------------------------------------------------------
def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole fp32 master weight of ``param`` (collective; None for a frozen parameter)."""
    owner = _owner(param, "safe_get_full_fp32_param")
    return None if owner is None else _read_full(owner, param, key=None)


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Sets ``param``'s fp32 master weight and the model's copy of it to ``value`` (its whole
    shape, the same on every rank)."""
    owner = _owner(param, "safe_set_full_fp32_param", setting=True)
    _write_full(owner, param, value, key=None, what="safe_set_full_fp32_param")
    owner.write_model_copy(param, whole=value.detach())


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's part of ``param``'s fp32 master weight (1-D; see the module docstring)."""
    owner = _owner(param, "safe_get_local_fp32_param")
    return None if owner is None else _read_local(owner, param, key=None)


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Sets this rank's part of ``param``'s fp32 master weight (and of the model's copy)."""
    owner = _owner(param, "safe_set_local_fp32_param", setting=True)
    _write_local(owner, param, value, key=None, what="safe_set_local_fp32_param")
    owner.write_model_copy(param, whole=None)


# --- optimizer state ----------------------------------------------------------------------------
def safe_get_full_optimizer_state(
    param: torch.nn.Parameter, optim_state_key: str
) -> torch.Tensor | None:
    """The whole optimizer state ``optim_state_key`` of ``param`` (collective)."""
    owner = _owner(param, "safe_get_full_optimizer_state")
    return None if owner is None else _read_full(owner, param, key=_key(optim_state_key))


def safe_set_full_optimizer_state(
    param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Sets the optimizer state ``optim_state_key`` of ``param`` to ``value`` (whole shape)."""
    owner = _owner(param, "safe_set_full_optimizer_state", setting=True)
    key = _key(optim_state_key)
    _write_full(owner, param, value, key=key, what="safe_set_full_optimizer_state")


def safe_get_local_optimizer_state(
    param: torch.nn.Parameter, optim_state_key: str
) -> torch.Tensor | None:
    """This rank's part of the optimizer state ``optim_state_key`` of ``param``."""
    owner = _owner(param, "safe_get_local_optimizer_state")
    return None if owner is None else _read_local(owner, param, key=_key(optim_state_key))


def safe_set_local_optimizer_state(
    param: torch.nn.Parameter, value: torch.Tensor, optim_state_key: str
) -> None:
    """Sets this rank's part of the optimizer state ``optim_state_key`` of ``param``."""
    owner = _owner(param, "safe_set_local_optimizer_state", setting=True)
    key = _key(optim_state_key)
    _write_local(owner, param, value, key=key, what="safe_set_local_optimizer_state")


# --- reduced gradients ----------------------------------------------------------------------------
def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The whole reduced fp32 gradient of ``param`` (collective; see the module docstring)."""
    owner = _owner(param, "safe_get_full_grad")
    if owner is None:
        return None
    if owner.local_grad is not None:  # inside engine.no_sync(): nothing is reduced yet
        local = owner.local_grad(param)
        if local is None:  # not used by any backward since the last zero_grad
            return torch.zeros(param.shape, dtype=torch.float32, device=param.device)
        return local.detach().float().mul(owner.gradient_scale()).reshape(param.shape)
    full = _assemble(owner, param, owner.fragment_grad(param))
    return full.mul_(owner.gradient_scale()) if owner.gradient_scale() != 1.0 else full


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replaces the reduced gradient of ``param`` (whole shape) before ``engine.step()``."""
    owner = _owner(param, "safe_set_full_grad", setting=True)
    grad = owner.fragment_grad(param)
    flat = _checked_whole(param, value, "safe_set_full_grad")
    _copy_part(owner.fragment_of(param), grad, flat, owner.gradient_scale())


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """This rank's part of the reduced fp32 gradient of ``param``."""
    owner = _owner(param, "safe_get_local_grad")
    if owner is None:
        return None
    return owner.fragment_grad(param).clone().mul_(owner.gradient_scale())


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Replaces this rank's part of the reduced gradient of ``param``."""
    owner = _owner(param, "safe_set_local_grad", setting=True)
    grad = owner.fragment_grad(param)
    _check_local(param, value, grad.numel(), "safe_set_local_grad")
    with torch.no_grad():
        grad.copy_(value.reshape(-1).to(grad) / owner.gradient_scale())


def safe_update_full_grad_vectorized(
    param_list: Iterable[torch.nn.Parameter],
    update_func: Callable[[torch.Tensor, torch.nn.Parameter], torch.Tensor],
) -> None:
    """For each trainable parameter: its reduced gradient becomes
    ``update_func(current full gradient, param)`` (collective, like ``safe_get_full_grad``)."""
    for param in param_list:
        if param.requires_grad:
            safe_set_full_grad(param, update_func(safe_get_full_grad(param), param))


# --- shared machinery -----------------------------------------------------------------------------
def _owner(param, what: str, *, setting: bool = False):
    """The optimizer training ``param``; None for a frozen one (getters only)."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"{what}: expected a model parameter, got {type(param).__name__}")
    from ..runtime.zero.param_fragments import fragment_owner  # runtime sits above utils

    owner = fragment_owner(param)
    if owner is not None:
        return owner
    if not param.requires_grad:
        if not setting:
            return None
        raise UnmanagedParameterError(
            f"{what}: parameter {_describe(param)} is frozen (requires_grad=False): it has no "
            f"fp32 master, optimizer state or gradient to set"
        )
    raise UnmanagedParameterError(
        f"{what}: parameter {_describe(param)} is not trained by a live deepspeed_cpp engine "
        f"(its model was not passed to deepspeed_cpp.initialize, the engine was destroyed, or it "
        f"is not among the optimizer's parameters)"
    )


def _key(optim_state_key) -> str:
    if not isinstance(optim_state_key, str):
        raise TypeError(
            f"optim_state_key must be the name of an optimizer state (e.g. 'exp_avg'), got "
            f"{optim_state_key!r}"
        )
    return optim_state_key


def _read_full(owner, param, key: str | None) -> torch.Tensor:
    with owner.fragment_values(param, key, write=False) as values:
        return _assemble(owner, param, values)


def _assemble(owner, param, values: torch.Tensor) -> torch.Tensor:
    """The whole tensor from every rank's fragment: each rank writes its part into zeros and
    the sum over the group is exact (every element comes from exactly one rank)."""
    fragment = owner.fragment_of(param)
    full = torch.zeros(
        fragment.whole_numel, dtype=torch.float32, device=owner.communication_device()
    )
    kept = _unpadded(fragment)
    if kept:
        full.narrow(0, fragment.param_start, kept).copy_(values.narrow(0, 0, kept))
    if not fragment.replicated and owner.world_size > 1:
        dist.all_reduce(full, group=owner.group)
    return full.view(_shape(param))


def _read_local(owner, param, key: str | None) -> torch.Tensor:
    with owner.fragment_values(param, key, write=False) as values:
        return values.to(owner.communication_device(), dtype=torch.float32, copy=True)


def _write_full(owner, param, value, key: str | None, what: str) -> None:
    flat = _checked_whole(param, value, what)
    with owner.fragment_values(param, key, write=True) as values:
        _copy_part(owner.fragment_of(param), values, flat, 1.0)


def _write_local(owner, param, value, key: str | None, what: str) -> None:
    with owner.fragment_values(param, key, write=True) as values:
        _check_local(param, value, values.numel(), what)
        values.copy_(value.reshape(-1).to(values))


def _copy_part(fragment, target: torch.Tensor, flat: torch.Tensor, scale: float) -> None:
    """Writes this rank's part of the whole ``flat`` into ``target`` (its fragment), divided by
    ``scale``; a shard's padding is left as it is."""
    kept = _unpadded(fragment)
    if not kept:
        return
    part = flat.narrow(0, fragment.param_start, kept).to(target)
    with torch.no_grad():
        target.narrow(0, 0, kept).copy_(part if scale == 1.0 else part / scale)


def _unpadded(fragment) -> int:
    """How many of the fragment's elements are the parameter's (not shard padding)."""
    return max(0, min(fragment.numel, fragment.whole_numel - fragment.param_start))


def _checked_whole(param, value, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: value must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != _shape(param):
        raise ValueError(
            f"{what}: value has shape {list(value.shape)}, parameter {_describe(param)} has "
            f"{list(_shape(param))}"
        )
    return value.detach().reshape(-1)


def _check_local(param, value, numel: int, what: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{what}: value must be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != (numel,):
        raise ValueError(
            f"{what}: value has shape {list(value.shape)}; this rank's part of parameter "
            f"{_describe(param)} has shape [{numel}] (safe_get_local_* gives it)"
        )


def _shape(param) -> tuple[int, ...]:
    return tuple(param.ds_shape) if hasattr(param, "ds_id") else tuple(param.shape)


def _describe(param) -> str:
    name = getattr(param, "ds_name", None)
    return f"'{name}' (shape {list(_shape(param))})" if name else f"of shape {list(_shape(param))}"
