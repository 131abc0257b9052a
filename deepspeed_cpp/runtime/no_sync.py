"""``engine.no_sync()``: DeepSpeed's context manager for backward passes that skip the gradient
reduction over the data-parallel group, with DeepSpeed 0.19.8's semantics:

- Inside the block ``engine.backward(loss)`` computes gradients as usual (divided by the
  accumulation steps, multiplied by the fp16 loss scale) and does not reduce them: each rank
  accumulates its own. ``engine.step()`` inside the block raises; so does entering it again
  while inside (nesting).
- The first backward after the block that ends an accumulation (``is_gradient_accumulation_
  boundary()``) reduces everything accumulated since the last step, the block's backward passes
  included, averaged over the ranks; the ``engine.step()`` after it steps with that. The block's
  backward passes count no micro-steps (only ``step()`` does, as in DeepSpeed).
- ZeRO stages 2 and 3 refuse the block: they partition the gradients as they reduce them, in
  every backward, so there is no whole local gradient to accumulate.
- Inside the block ``safe_get_full_grad(param)`` reads this rank's own accumulated gradient
  (fp32, loss scale removed, no communication): the reduced one does not exist yet.

The errors are ``NoSyncError``, an ``AssertionError`` because DeepSpeed raises these with
``assert``: scripts (and DeepSpeed's tests) that catch ``AssertionError`` keep working.
"""

from __future__ import annotations


class NoSyncError(AssertionError):
    """``engine.no_sync()`` misused: under ZeRO 2/3, nested, or ``step()`` inside it."""


def refuse_entering(stage: int, inside: bool) -> None:
    """Raises NoSyncError where DeepSpeed refuses ``no_sync()``: ZeRO stage 2/3, or nested."""
    if stage >= 2:
        raise NoSyncError(
            f"engine.no_sync(): no_sync context manager is incompatible with gradient "
            f"partitioning logic of ZeRO stage {stage}: stages 2 and 3 reduce and partition the "
            f"gradients in every backward, so no whole local gradient could accumulate; use "
            f"ZeRO stage 0 or 1, or raise gradient_accumulation_steps instead"
        )
    if inside:
        raise NoSyncError(
            "engine.no_sync(): no_sync context manager reentry is unsupported (this engine is "
            "already inside a no_sync() block)"
        )


def refuse_step_inside(global_step: int) -> None:
    raise NoSyncError(
        f"engine.step() at global step {global_step}: It is illegal to call Engine.step() "
        f"inside no_sync context manager: the gradients of the backward passes inside it are "
        f"not reduced yet; leave the block and run one more backward (it reduces everything "
        f"accumulated), then step"
    )
