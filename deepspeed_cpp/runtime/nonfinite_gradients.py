"""Steps whose global gradient holds NaN or inf: skipped on every rank, or an error.

A ZeRO stage takes the global gradient norm at every step (after the reduction, before
clipping); it is all-reduced over the ranks (stage 0: every rank holds the same all-reduced
gradient), and with model parallelism over the model-parallel group too (``model_parallel.py``),
so every rank of the world sees the same value and no extra pass or collective is needed to agree.
A norm that is not finite means some element of the reduced gradient is not (NaN and inf survive
the sum of squares; a sum of squares past float's range, ~1e19 per element, counts too, as in
DeepSpeed's bf16 optimizer, which checks the same norm). The stage then steps nothing: parameters,
fp32 masters, optimizer state and the LR schedule stay as they were and the gradients are
cleared, as DeepSpeed does ("OVERFLOW! Skipping step"). fp16 runs check their scaled gradients
first, element by element, and lower the loss scale (``loss_scaler.py``): an overflow there is the
scaler's signal, so ``"raise"`` applies to fp32 and bf16.

``nonfinite_gradients`` (a deepspeed_cpp extension, top level of the config): ``"skip"`` (the
default) counts the step in ``engine.skipped_steps`` and logs it once; ``"raise"`` skips it the
same way and then raises ``NonFiniteGradientError`` on every rank.
"""

from __future__ import annotations

from ..utils.logging import logger

KEY = "nonfinite_gradients"
SKIP = "skip"
RAISE = "raise"
CHOICES = (SKIP, RAISE)


class NonFiniteGradientError(FloatingPointError):
    """The global gradient of an optimizer step held NaN or inf (``nonfinite_gradients`` is
    ``"raise"``, or the step could not be skipped whole); the message says which step."""


def skipped_step_message(step: int, norm: float | None, skipped_steps: int) -> str:
    """One line for the log (rank 0) or the error: which step, the norm, what was kept."""
    return (
        f"non-finite gradients at step {step} (global gradient norm {norm}, after the "
        f"reduction over every rank, before clipping): the step was skipped on every rank; "
        f"parameters, optimizer state and the LR schedule are unchanged "
        f"(skipped_steps = {skipped_steps})"
    )


def report_skipped_step(
    logs: bool, step: int, norm: float | None, skipped_steps: int, loss_scaler
) -> str | None:
    """Logs a skipped step once (``logs``: on rank 0); returns the text of a non-finite one
    (None for fp16's overflow, which the loss scaler handles)."""
    if loss_scaler is not None:
        if logs:
            logger.info(
                "deepspeed_cpp: gradient overflow at step %d: step skipped, loss scale now %s",
                step,
                loss_scaler.loss_scale,
            )
        return None
    message = skipped_step_message(step, norm, skipped_steps)
    if logs:
        logger.warning("deepspeed_cpp: %s", message)
    return message


def raise_if_asked(policy: str, message: str) -> None:
    if policy == RAISE:
        raise NonFiniteGradientError(f"{message}; raised because {KEY} = {RAISE!r}")
