"""What the engine remembers of an optimizer step that raised.

A step that fails part-way (a swap write past a full disk or a file size limit, a peer that
stops answering in the step's all-reduce or all-gather, an interrupt) leaves the training state
part-updated: with NVMe offload, the sub-groups stepped before the failure have their new values
in the swap files and the model, the others their old ones. Training on from there, or saving
it as a checkpoint, would carry that mix on silently. So after such a failure the engine
refuses to go on (forward, backward, step, saving) with an error naming the failed step and its
cause, until a checkpoint is loaded whole (``engine.load_checkpoint``), which replaces every
part of the state the step could have touched.
"""

from __future__ import annotations


class FailedStepError(RuntimeError):
    """The engine's last optimizer step failed part-way; load a checkpoint to go on."""


class FailedStepGuard:
    def __init__(self) -> None:
        self._failure: str | None = None

    def record(self, global_step: int, error: BaseException) -> None:
        self._failure = (
            f"the optimizer step at global step {global_step} failed "
            f"({type(error).__name__}: {error})"
        )

    def check(self, what: str) -> None:
        """Raises FailedStepError for ``what`` ("engine.forward", ...) after a failed step."""
        if self._failure is not None:
            raise FailedStepError(
                f"{what}: {self._failure}; parameters and optimizer state may be part-updated "
                f"(each sub-group stepped before the failure holds its new values), so the "
                f"engine will not train on or save them: load a checkpoint "
                f"(engine.load_checkpoint(dir), optimizer states included) to continue"
            )

    def clear(self) -> None:
        self._failure = None
