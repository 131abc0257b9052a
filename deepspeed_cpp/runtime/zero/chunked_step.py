"""Steps torch's element-wise optimizers over large flat master tensors in cache-sized chunks.

ZeRO keeps one flat fp32 master per bucket (millions of elements). torch's ``Adam``/``AdamW``
on the CPU (single-tensor or foreach) run one whole-tensor operation after another (``lerp_``,
``mul_``, ``addcmul_``, ``sqrt``, ``addcdiv_``): over a 12.6M-element master every operation
streams 50 MB from memory, where over 256K-element pieces the pieces of master, gradient and both
moments stay in the core's cache from one operation to the next. Measured here (one thread, one
step over 12.6M elements): 0.13-0.16 s over the flat tensor, 0.06-0.09 s over 256K chunks.

Adam's update is element-wise, so stepping the chunks equals stepping the whole tensor bit for
bit. The optimizer is stepped once, its param groups temporarily holding views of each master's
chunks and its state views of the per-element state (``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``), updated in place; every chunk gets its own copy of the per-tensor counter
(``step``), which is written back once. The optimizer's state keeps its layout (one entry per
master), so its ``state_dict`` and checkpoints do not change.

Chunked only: ``torch.optim.Adam`` and ``AdamW`` (exact classes; a subclass may keep other
state), once every master's state exists (the first step initialises it over the whole master).
"""

from __future__ import annotations

import torch

# Elements per chunk: four fp32 streams of 1 MiB each (master, gradient, two moments) plus
# Adam's temporaries fit in a core's L2 cache; 128K-1M measured alike, 4M as slow as no chunks.
CHUNK_ELEMENTS = 1 << 18

_CHUNKED_TYPES = (torch.optim.Adam, torch.optim.AdamW)


def can_step_in_chunks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s next step may run over chunks: a known element-wise optimizer
    whose every parameter's state exists, holding per-element tensors and 0-dim counters only."""
    if type(optimizer) not in _CHUNKED_TYPES:
        return False
    for group in optimizer.param_groups:
        if group.get("differentiable", False):
            return False
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                return False
            for value in state.values():
                if not torch.is_tensor(value):
                    return False
                if value.dim() != 0 and value.shape != param.shape:
                    return False
    return True


def step_in_chunks(optimizer: torch.optim.Optimizer, chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """One ``optimizer.step()`` over chunks of its 1-D parameters (see the module docstring);
    call only where ``can_step_in_chunks(optimizer)``. Parameters without a gradient are left
    out, as the optimizer itself does."""
    originals = [group["params"] for group in optimizer.param_groups]
    chunk_owners: list[tuple[torch.Tensor, torch.nn.Parameter]] = []
    try:
        for group, params in zip(optimizer.param_groups, originals):
            group["params"] = [
                chunk
                for param in params
                for chunk in _chunks(optimizer, param, chunk_elements, chunk_owners)
            ]
        optimizer.step()
    finally:
        for group, params in zip(optimizer.param_groups, originals):
            group["params"] = params
        _write_back_counters(optimizer, chunk_owners)


def _chunks(optimizer, param, chunk_elements: int, chunk_owners: list) -> list:
    """``param`` itself where it is small or has no gradient, else views of its chunks, each
    with its gradient and its state (views of the per-element state, copies of the counters)
    registered in the optimizer."""
    if param.grad is None or param.dim() != 1 or param.numel() <= chunk_elements:
        return [param]
    state = optimizer.state[param]
    data, grad = param.detach(), param.grad
    chunks = []
    for start in range(0, param.numel(), chunk_elements):
        length = min(chunk_elements, param.numel() - start)
        chunk = torch.nn.Parameter(data.narrow(0, start, length), requires_grad=True)
        chunk.grad = grad.narrow(0, start, length)
        optimizer.state[chunk] = {
            key: value.narrow(0, start, length) if value.dim() else value.clone()
            for key, value in state.items()
        }
        chunk_owners.append((param, chunk))
        chunks.append(chunk)
    return chunks


def _write_back_counters(optimizer, chunk_owners: list) -> None:
    """Every chunk of a parameter advanced its copy of the counters alike: the first chunk's are
    the parameter's. The chunks' state entries are removed."""
    written: set[int] = set()
    for param, chunk in chunk_owners:
        chunk_state = optimizer.state.pop(chunk)
        if id(param) in written:
            continue
        written.add(id(param))
        state = optimizer.state[param]
        for key, value in chunk_state.items():
            if value.dim() == 0:
                state[key] = value
