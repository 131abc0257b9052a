"""The engine's entry points for a torch-style backward (``torch_backward.py`` holds the hooks
and the contract): ``engine.scale(loss).backward()`` for fp16, and DeepSpeed's
``_backward_epilogue()`` that scripts call after their own ``loss.backward()``."""

from __future__ import annotations

import torch


class EngineTorchBackward:
    """Mixed into ``DeepSpeedEngine``: reads its ``optimizer``, ``loss_scaler`` and the
    ``TorchBackward`` it set up (``_torch_backward``)."""

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the fp16 loss scale (itself otherwise), for ``engine.scale(loss)
        .backward()`` in place of ``engine.backward(loss)`` (torch_backward.py: the engine's
        hooks divide by the accumulation steps and reduce)."""
        if self.optimizer is None:
            raise RuntimeError(
                "engine.scale(loss) needs an optimizer (in the config or initialize)"
            )
        if not (isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.grad_fn is not None):
            raise ValueError(
                f"engine.scale(loss): loss must be a one-element tensor with a grad_fn, got "
                f"{type(loss).__name__}"
                + (
                    f" of shape {tuple(loss.shape)} (grad_fn {loss.grad_fn})"
                    if isinstance(loss, torch.Tensor)
                    else ""
                )
                + "; for a non-scalar output call output.backward(gradient)"
            )
        self._torch_backward.scaled_by_engine = True
        if self.loss_scaler is None or self.loss_scaler.loss_scale == 1.0:
            return loss
        return loss * self.loss_scaler.loss_scale

    def _backward_epilogue(self) -> None:
        """DeepSpeed's name, which scripts call after their own ``loss.backward()``: reduces
        the gradients that backward left in the parameters (nothing when its epilogue already ran
        by itself; see torch_backward.py)."""
        if self.optimizer is None:
            raise RuntimeError("engine._backward_epilogue() needs an optimizer")
        self._torch_backward.script_epilogue()
