"""``zero_optimization.ignore_unused_parameters = false``: a trainable parameter that got no
gradient in an optimizer step is an error, as in DeepSpeed.

DeepSpeed 0.19.8 checks it only where its ZeRO 1/2 optimizer offloads to the CPU (it looks for
each parameter's gradient norm there and asserts, naming the key, when one is missing); the
default, true, and every other stage or setting let such a parameter through with a zero
gradient, as deepspeed_cpp always does. The check here runs where DeepSpeed's does, on every
rank before any collective of the step, so that a model that leaves a parameter unused (the same
on every rank) fails on every rank rather than leaving the others waiting.
"""

from __future__ import annotations

import torch


class UnusedParameterCheck:
    """Records which parameters (by index into ``params``) got a gradient since the last step."""

    def __init__(self, params: list[torch.Tensor]):
        self._trainable = [i for i, p in enumerate(params) if p.requires_grad]
        self._shapes = [tuple(p.shape) for p in params]
        self._seen: set[int] = set()

    def saw_gradient(self, index: int) -> None:
        self._seen.add(index)

    def check_and_reset(self) -> None:
        """Raises AssertionError (DeepSpeed's type) naming the parameters that got no gradient
        since the last call; then starts afresh for the next step."""
        missing = [i for i in self._trainable if i not in self._seen]
        self._seen.clear()
        if missing:
            shapes = ", ".join(f"#{i} {self._shapes[i]}" for i in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise AssertionError(
                f"{len(missing)} of {len(self._trainable)} trainable parameters got no gradient "
                f"in this optimizer step (the optimizer's parameters {shapes}{more}): they were "
                f"not used in producing the loss. Set zero_optimization.ignore_unused_parameters "
                f"to true (the default) to let them through with a zero gradient, or make every "
                f"trainable parameter and forward output take part in the loss"
            )
