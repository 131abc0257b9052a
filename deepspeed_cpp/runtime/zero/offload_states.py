"""DeepSpeed's ``deepspeed.runtime.zero.offload_states``: helpers that move an optimizer's state
tensors to another device and back (``offload_optimizer_states`` / ``reload_optimizer_states``,
the Adam variants keeping a reusable buffer per state) and ``get_state_devices``.

The engine's ``offload_states()`` / ``reload_states()`` are in ``runtime/engine_state_moves.py``
(on a CPU engine every state is on the host already; GPU buffers are not moved yet).
"""

from __future__ import annotations

import torch

from .offload_config import OffloadStateTypeEnum


def _make_offload_state_key(key: str) -> str:
    return f"{key}_offload_buffer"


def offload_optimizer_states(optimizer, device, pin_memory: bool = False, non_blocking=False):
    """Every tensor of ``optimizer.state`` moved to ``device`` (pinned when asked and on the
    host with a GPU present)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                moved = value.to(device, non_blocking=non_blocking)
                if pin_memory and moved.device.type == "cpu" and torch.cuda.is_available():
                    moved = moved.pin_memory()
                state[key] = moved


def reload_optimizer_states(optimizer, device, non_blocking: bool = False) -> list:
    """Every tensor of ``optimizer.state`` moved back to ``device``; returns the replaced host
    tensors (keep them alive until a non-blocking copy has finished)."""
    replaced = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value):
                replaced.append(value)
                state[key] = value.to(device, non_blocking=non_blocking)
    return replaced


def offload_adam_states(optimizer, device, pin_memory: bool = False, non_blocking=False):
    """Adam's ``exp_avg`` / ``exp_avg_sq`` moved to ``device`` through a buffer kept in the
    state (``<key>_offload_buffer``), reused by the next offload; the tensors stay the same
    objects (their ``.data`` is swapped)."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key not in state:
                continue
            buffer_key = _make_offload_state_key(key)
            if buffer_key not in state:
                buffer = torch.empty_like(state[key], device=device)
                if pin_memory and buffer.device.type == "cpu" and torch.cuda.is_available():
                    buffer = buffer.pin_memory()
                state[buffer_key] = buffer
            state[buffer_key].copy_(state[key], non_blocking=non_blocking)
            state[key].data = state[buffer_key]


def reload_adam_states(optimizer, device, non_blocking: bool = False):
    """Adam's ``exp_avg`` / ``exp_avg_sq`` back on ``device`` from their offload buffers."""
    for state in optimizer.state.values():
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                state[key].data = state[_make_offload_state_key(key)].to(
                    device, non_blocking=non_blocking
                )


def get_state_devices(model, state: OffloadStateTypeEnum) -> set:
    """The devices holding ``state`` of engine ``model``: its optimizer's states
    (``optim_states``), the parameters the optimizer steps (``hp_params``), the module's
    parameters (``lp_params``) or their gradients (``lp_grads``)."""
    state = OffloadStateTypeEnum(state)
    optimizer = getattr(model.optimizer, "optimizer", model.optimizer)
    if state == OffloadStateTypeEnum.optim_states:
        return {
            value.device
            for per_param in optimizer.state.values()
            for value in per_param.values()
            if torch.is_tensor(value) and value.dim() > 0
        }
    if state == OffloadStateTypeEnum.hp_params:
        return {p.device for group in optimizer.param_groups for p in group["params"]}
    if state == OffloadStateTypeEnum.lp_params:
        return {p.device for p in model.module.parameters()}
    if state == OffloadStateTypeEnum.lp_grads:
        return {p.grad.device for p in model.module.parameters() if p.grad is not None}
    raise ValueError(
        f"get_state_devices: {state.value!r} has no counterpart in deepspeed_cpp (no contiguous "
        "gradient buffer); allowed: optim_states, hp_params, lp_params, lp_grads"
    )
