"""The ZeRO-Offload paper's delayed parameter update (DPU): the CPU optimizer step of step t runs
in a background thread while step t+1's forward and backward run on parameters one step stale.

After ``warmup_steps`` ordinary steps, each step hands its optimizer work to ``launch``; the next
step (or anything that needs the parameters current: a checkpoint, a consolidated state dict)
calls ``finish`` first, which waits for it and re-raises what it raised. The hyper-parameters
the work uses are those of the step that launched it: the caller snapshots them before the LR
scheduler moves on. (A deepspeed_cpp extension, configured by
``offload_optimizer.delayed_param_update`` and ``delayed_param_update_warmup_steps``.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class DelayedUpdate:
    """Runs at most one optimizer step in the background at a time."""

    def __init__(self, warmup_steps: int) -> None:
        self.warmup_steps = int(warmup_steps)
        self.steps_seen = 0
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def next_step_is_delayed(self) -> bool:
        """Counts a step; True once the warm-up steps are done."""
        self.steps_seen += 1
        return self.steps_seen > self.warmup_steps

    @property
    def pending(self) -> bool:
        return self._thread is not None

    def launch(self, work: Callable[[], None]) -> None:
        if self._thread is not None:
            raise RuntimeError("DelayedUpdate.launch: the previous step was not finished")

        def run() -> None:
            try:
                work()
            except BaseException as error:  # re-raised in the training thread by finish()
                self._error = error

        self._thread = threading.Thread(target=run, name="deepspeed_cpp-dpu", daemon=True)
        self._thread.start()

    def finish(self) -> bool:
        """Waits for the background step; True when there was one. Re-raises its error."""
        if self._thread is None:
            return False
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError(f"the delayed optimizer step failed: {error}") from error
        return True
