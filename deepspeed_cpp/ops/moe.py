"""Python entry point of csrc/moe: the Mixture-of-Experts gating dispatch op and its autograd."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .op_builder import MoEBuilder, MoECudaBuilder

_ready: set[str] = set()


class Gating(NamedTuple):
    """Per (token, slot) routing of a batch; ``[tokens, k]`` each, ``slot_counts`` ``[k, E]``."""

    weight: torch.Tensor  # logits' dtype: combine weight (0 when dropped); differentiable
    expert: torch.Tensor  # int64: the expert chosen for this slot
    position: torch.Tensor  # int64: place in that expert's capacity buffer; -1 when dropped
    kept: torch.Tensor  # bool: the token fits the expert's capacity
    slot_counts: torch.Tensor  # int64: choices per (slot, expert) before any drop


def load_moe(device_type: str = "cpu") -> None:
    """Loads the op library (and the CUDA one for CUDA tensors); registers fakes and autograd."""
    if "cpu" not in _ready:
        MoEBuilder().load()
        torch.library.register_fake("deepspeed_cpp::moe_gating")(_fake_gating)
        torch.library.register_fake("deepspeed_cpp::moe_gating_backward")(_fake_backward)
        torch.library.register_autograd(
            "deepspeed_cpp::moe_gating", _gating_backward, setup_context=_gating_setup_context
        )
        _ready.add("cpu")
    if device_type == "cuda" and "cuda" not in _ready:
        MoECudaBuilder().load()
        _ready.add("cuda")


def _fake_gating(logits, k, capacity, noise=None, priority=None):
    tokens, experts = logits.shape
    if k not in (1, 2):
        raise ValueError(f"moe_gating: k must be 1 or 2, got {k}")
    index = logits.new_empty((tokens, k), dtype=torch.long)
    return (
        logits.new_empty((tokens, k)),
        index,
        torch.empty_like(index),
        logits.new_empty((tokens, k), dtype=torch.bool),
        logits.new_empty((k, experts), dtype=torch.long),
    )


def _fake_backward(grad_weight, logits, expert, kept):
    return torch.empty_like(logits)


def _gating_setup_context(ctx, inputs, output):
    logits = inputs[0]
    _, expert, position, kept, slot_counts = output
    ctx.mark_non_differentiable(expert, position, kept, slot_counts)
    ctx.save_for_backward(logits, expert, kept)


def _gating_backward(ctx, grad_weight, grad_expert, grad_position, grad_kept, grad_counts):
    logits, expert, kept = ctx.saved_tensors
    grad_logits = None
    if grad_weight is not None and ctx.needs_input_grad[0]:
        grad_logits = torch.ops.deepspeed_cpp.moe_gating_backward.default(
            grad_weight.contiguous(), logits, expert, kept
        )
    # logits, k, capacity, noise, priority: the noise and the priorities only choose.
    return grad_logits, None, None, None, None


def moe_gating(
    logits: torch.Tensor,
    k: int,
    capacity: int,
    *,
    noise: torch.Tensor | None = None,
    priority: torch.Tensor | None = None,
) -> Gating:
    """Routes ``tokens`` over ``experts`` as DeepSpeed's top1gating / top2gating do.

    ``logits`` is ``[tokens, experts]``, float32 or float64; ``k`` is 1 or 2; each expert takes at
    most ``capacity`` tokens (``capacity < 0``: all of them). ``noise`` (logits' shape, e.g.
    Gumbel samples) is added to the logits when choosing the last slot's expert: top-1 RSample,
    top-2 second-expert sampling. ``priority`` (``[tokens]``, k = 1 only) makes tokens of higher
    priority claim an expert's capacity first (random token selection); without it tokens claim
    it in token order, every first choice before any second one. Ties between experts go to the
    lower index; between priorities, to the lower token index; a NaN priority ranks above every
    number, as ``torch.topk`` (DeepSpeed's selection) orders it. Gradients flow from ``weight``
    to ``logits``.
    """
    load_moe(logits.device.type)
    return Gating(
        *torch.ops.deepspeed_cpp.moe_gating.default(logits, int(k), int(capacity), noise, priority)
    )
