"""DeepSpeed's loss-scale attributes of its ZeRO optimizers, read by scripts (and DeepSpeed's
tests) that watch fp16 training: ``optimizer.dynamic_loss_scale`` and
``optimizer.loss_scale_config`` (``cur_scale``, ``cur_iter``, ``scale_window``, ...), here a
read-only view of the engine's loss scaler (``ZeroPartitionedOptimizer.loss_scale_config``), so
they always say what the scaler does."""

from __future__ import annotations


class LossScaleConfigView:
    """DeepSpeed's ``LossScaleConfig`` fields over a loss scaler (None: no fp16 scaling)."""

    def __init__(self, scaler):
        self._scaler = scaler

    @property
    def use_grad_scaling(self) -> bool:
        return self._scaler is not None

    @property
    def dynamic_loss_scale(self) -> bool:
        return bool(getattr(self._scaler, "dynamic", False))

    @property
    def cur_scale(self) -> float:
        return 1.0 if self._scaler is None else float(self._scaler.loss_scale)

    @property
    def cur_iter(self) -> int:
        return getattr(self._scaler, "cur_iter", 0)

    @property
    def last_overflow_iter(self):
        return getattr(self._scaler, "last_overflow_iter", None)

    @property
    def scale_factor(self):
        return getattr(self._scaler, "scale_factor", None)

    @property
    def scale_window(self):
        return getattr(self._scaler, "scale_window", None)

    @property
    def min_loss_scale(self):
        return getattr(self._scaler, "min_scale", None)
