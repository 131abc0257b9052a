"""fp16 loss scaling with DeepSpeed's semantics: a static scale, or a dynamic one with hysteresis.

fp16 gradients underflow to 0 below 2**-24; multiplying the loss by a large scale before
``backward()`` keeps them representable, and the optimizer divides it back out. Too large a
scale overflows instead (inf/nan gradients): the step is then skipped and the dynamic scaler
lowers the scale; after a long enough run without overflow it raises it again.

``make_loss_scaler(fp16_config)`` builds the scaler a ``ds_config.json`` ``fp16`` section asks
for; ``has_inf_or_nan(tensors)`` is the overflow check.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Iterable, Mapping

import torch

from ..utils.logging import logger

# DeepSpeed's fp16 section defaults (its precision config).
FP16_DEFAULTS = {
    "loss_scale": 0.0,
    "initial_scale_power": 16,
    "loss_scale_window": 1000,
    "hysteresis": 2,
    "consecutive_hysteresis": False,
    "min_loss_scale": 1.0,
}


# --------------------------------------------------------------------------------------------
# The overflow check.
# --------------------------------------------------------------------------------------------


def _float_tensors(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The non-empty floating tensors (complex ones seen as real pairs); others cannot hold inf."""
    result = []
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensors[{index}] must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_complex():
            tensor = torch.view_as_real(tensor)
        if tensor.is_floating_point() and tensor.numel() > 0:
            result.append(tensor)
    return result


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return groups


def _extremes_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-dim bool on the tensors' device: every element finite. Exact: min/max cannot overflow.

    One read of each tensor (``aminmax``), no temporary the size of the input, and the
    reductions propagate nan, so a single nan or +-inf anywhere reaches the result.
    """
    extremes = [value.float() for tensor in tensors for value in torch.aminmax(tensor)]
    return torch.stack(extremes).isfinite().all()


def found_inf_or_nan(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor, true when any element of ``tensors`` is inf, -inf or nan.

    No host synchronisation: the flag stays on the device of the first tensor (CPU for an
    empty list), ready to be all-reduced across ranks before the skip-step decision.
    """
    tensors = _float_tensors(tensors)
    if not tensors:
        return torch.zeros((), dtype=torch.bool)
    home = tensors[0].device
    flags = [~_extremes_finite(group).to(home) for group in _by_device(tensors).values()]
    return torch.stack(flags).any()


def has_inf_or_nan(tensors: Iterable[torch.Tensor]) -> bool:
    """True when any element of ``tensors`` (gradients, typically) is inf, -inf or nan.

    Exact for every floating dtype, and fast where it matters: one read per tensor, one host
    synchronisation per device (two when a sum is non-finite). A sum is non-finite whenever
    an element is (inf and nan survive any addition), so non-fp16 tensors are screened with a
    plain ``sum()``, the fastest full read torch has; only a non-finite sum (a real overflow,
    or finite values summing past the float32 range) triggers the exact ``aminmax`` check of
    those tensors. fp16 sums leave fp16's range (65504) too easily, so fp16 tensors go to
    ``aminmax`` at once.
    """
    for group in _by_device(_float_tensors(tensors)).values():
        wide = [t for t in group if t.dtype != torch.float16]
        half = [t for t in group if t.dtype == torch.float16]
        if wide:
            sums_finite = torch.stack([t.sum().float() for t in wide]).isfinite().tolist()
            half += [t for t, finite in zip(wide, sums_finite) if not finite]
        if half and not bool(_extremes_finite(half)):
            return True
    return False


# --------------------------------------------------------------------------------------------
# The scalers.
# --------------------------------------------------------------------------------------------


def _positive_finite(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def _int_at_least(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _boolean(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def _required(state_dict: Mapping, key: str, owner: str):
    if key not in state_dict:
        raise ValueError(f"{owner} state_dict needs the key {key!r}, got keys {sorted(state_dict)}")
    return state_dict[key]


class LossScaleAtMinimumError(RuntimeError):
    """Gradients overflowed with the dynamic loss scale already at its minimum."""


class LossScalerBase:
    """What the engine uses: ``loss_scale``, ``scale_loss``, ``update_scale``, state dicts."""

    dynamic = False

    def __init__(self, scale: float):
        self.cur_scale = scale

    @property
    def loss_scale(self) -> float:
        """The factor the loss is multiplied by before ``backward()``."""
        return self.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``, to call ``backward()`` on."""
        return loss * self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """Records one optimizer step's outcome (True: its gradients held inf/nan)."""

    def load_state_dict(self, state_dict: Mapping) -> None:
        """Restores a saved ``state_dict()`` (see ``_load``)."""
        self._load(state_dict, announce=True)

    def check_state_dict(self, state_dict: Mapping) -> None:
        """Raises what ``load_state_dict(state_dict)`` would, changing nothing (and saying
        nothing): a checkpoint checks every state before it restores any."""
        copy.copy(self)._load(state_dict, announce=False)

    def _load(self, state_dict: Mapping, announce: bool) -> None:
        raise NotImplementedError

    has_inf_or_nan = staticmethod(has_inf_or_nan)
    found_inf_or_nan = staticmethod(found_inf_or_nan)


class StaticLossScaler(LossScalerBase):
    """A constant loss scale (DeepSpeed's ``fp16.loss_scale > 0``); overflowing steps are
    still skipped by the engine, but the scale never changes."""

    def __init__(self, scale: float = 1.0):
        super().__init__(_positive_finite("scale", scale))

    def state_dict(self) -> dict:
        """The scale."""
        return {"cur_scale": self.cur_scale}

    def _load(self, state_dict: Mapping, announce: bool) -> None:
        """Restores the scale; a dynamic scaler's state (a run saved with ``loss_scale: 0``) is
        a point on its trajectory, not a chosen constant, so this scaler keeps its own."""
        scale = _required(state_dict, "cur_scale", type(self).__name__)
        scale = _positive_finite("state_dict['cur_scale']", scale)
        if "cur_iter" in state_dict:
            if announce:
                logger.info(
                    "deepspeed_cpp: the checkpoint's loss scale was dynamic (%s); keeping the "
                    "static fp16.loss_scale %s",
                    scale,
                    self.cur_scale,
                )
            return
        self.cur_scale = scale


class DynamicLossScaler(LossScalerBase):
    """DeepSpeed's dynamic loss scale: lowered on overflow (with hysteresis), raised when stable.

    ``update_scale(overflow)`` is called once per optimizer step, in iteration ``cur_iter``
    (counting from 0), and applies these rules, then increments ``cur_iter``:

    - Overflow: if ``delayed_shift == 1`` or ``cur_hysteresis == 1`` the scale is divided by
      ``scale_factor``, but not below ``min_scale`` (when it already *is* ``min_scale`` and
      ``raise_error_at_min_scale`` is true, ``LossScaleAtMinimumError`` is raised instead).
      Otherwise the scale is kept and ``cur_hysteresis`` decremented: the first
      ``delayed_shift - 1`` overflows are tolerated. Either way ``last_overflow_iter =
      cur_iter``.
    - No overflow: with ``consecutive_hysteresis``, ``cur_hysteresis`` is refilled to
      ``delayed_shift`` (so only back-to-back overflows exhaust it). Then, with
      ``stable = cur_iter - last_overflow_iter - 1`` (``last_overflow_iter`` starts at -1), the
      scale is multiplied by ``scale_factor`` when ``stable > 0`` and ``stable % scale_window
      == 0``; that growth also refills ``cur_hysteresis`` when ``consecutive_hysteresis`` is
      off (the only refill then).

    So the scale first grows at the ``scale_window + 1``-th clean step after an overflow (or
    at ``cur_iter == scale_window`` in a run that never overflowed), then every
    ``scale_window`` clean steps; the scale is not capped from above.

    Args:
        init_scale: the first scale (DeepSpeed's ``2 ** fp16.initial_scale_power``).
        scale_factor: the factor the scale is divided or multiplied by (> 1).
        scale_window: clean steps between increases (>= 1; ``fp16.loss_scale_window``).
        min_scale: the scale's floor (``fp16.min_loss_scale``), <= ``init_scale``.
        delayed_shift: overflows it takes to lower the scale (>= 1; ``fp16.hysteresis``).
        consecutive_hysteresis: refill the hysteresis on every clean step, not only on growth.
        raise_error_at_min_scale: fail on an overflow at ``min_scale`` rather than keep
            skipping steps there (DeepSpeed's default).
    """

    dynamic = True

    def __init__(
        self,
        init_scale: float = 2.0**16,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        min_scale: float = 1.0,
        delayed_shift: int = 1,
        consecutive_hysteresis: bool = False,
        raise_error_at_min_scale: bool = True,
    ):
        super().__init__(_positive_finite("init_scale", init_scale))
        self.scale_factor = _positive_finite("scale_factor", scale_factor)
        if self.scale_factor <= 1.0:
            raise ValueError(f"scale_factor must be > 1, got {scale_factor!r}")
        self.scale_window = _int_at_least("scale_window", scale_window, 1)
        self.min_scale = _positive_finite("min_scale", min_scale)
        if self.min_scale > self.cur_scale:
            raise ValueError(f"min_scale ({min_scale!r}) must be <= init_scale ({init_scale!r})")
        self.delayed_shift = _int_at_least("delayed_shift", delayed_shift, 1)
        self.consecutive_hysteresis = _boolean("consecutive_hysteresis", consecutive_hysteresis)
        self.raise_error_at_min_scale = _boolean(
            "raise_error_at_min_scale", raise_error_at_min_scale
        )
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.cur_hysteresis = self.delayed_shift

    def update_scale(self, overflow: bool) -> None:
        """Applies the class docstring's rules for one optimizer step."""
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimumError(
                        f"fp16 gradients overflowed at iteration {self.cur_iter} with the loss "
                        f"scale already at min_scale={self.min_scale}; the model produces "
                        "inf/nan even unscaled. Lower fp16.min_loss_scale, or pass "
                        "raise_error_at_min_scale=False to keep skipping steps"
                    )
                self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = self.cur_iter - self.last_overflow_iter - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    def state_dict(self) -> dict:
        """The running state (DeepSpeed's names); the settings come from the config."""
        return {
            "cur_scale": self.cur_scale,
            "cur_iter": self.cur_iter,
            "last_overflow_iter": self.last_overflow_iter,
            "cur_hysteresis": self.cur_hysteresis,
        }

    def _load(self, state_dict: Mapping, announce: bool) -> None:
        """Restores the running state; the next ``update_scale`` continues the trajectory. A
        static scaler's state (a run saved with ``loss_scale > 0``, its only key ``cur_scale``)
        starts a fresh trajectory at that scale (not below ``min_scale``)."""
        owner = type(self).__name__
        if set(state_dict) == {"cur_scale"}:
            scale = _positive_finite("state_dict['cur_scale']", state_dict["cur_scale"])
            self.cur_scale = max(scale, self.min_scale)
            self.cur_iter, self.last_overflow_iter = 0, -1
            self.cur_hysteresis = self.delayed_shift
            if announce:
                logger.info(
                    "deepspeed_cpp: the checkpoint's loss scale was static; dynamic scaling "
                    "starts at it (%s)",
                    self.cur_scale,
                )
            return
        scale = _required(state_dict, "cur_scale", owner)
        cur_iter = _required(state_dict, "cur_iter", owner)
        last_overflow = _required(state_dict, "last_overflow_iter", owner)
        hysteresis = _required(state_dict, "cur_hysteresis", owner)
        self.cur_scale = _positive_finite("state_dict['cur_scale']", scale)
        self.cur_iter = _int_at_least("state_dict['cur_iter']", cur_iter, 0)
        self.last_overflow_iter = _int_at_least(
            "state_dict['last_overflow_iter']", last_overflow, -1
        )
        self.cur_hysteresis = _int_at_least("state_dict['cur_hysteresis']", hysteresis, 1)


# --------------------------------------------------------------------------------------------
# The factory for a ds_config.json "fp16" section.
# --------------------------------------------------------------------------------------------


def _config_value(fp16_config, key: str):
    if isinstance(fp16_config, Mapping):
        value = fp16_config.get(key)
    else:
        value = getattr(fp16_config, key, None)
    return FP16_DEFAULTS[key] if value is None else value


def make_loss_scaler(
    fp16_config, *, raise_error_at_min_scale: bool = True, hysteresis: bool = True
) -> LossScalerBase:
    """The loss scaler a ``ds_config.json`` ``fp16`` section asks for.

    ``fp16_config`` is a dict or any object with DeepSpeed's fp16 keys as attributes; missing
    keys take DeepSpeed's defaults (``FP16_DEFAULTS``). ``loss_scale > 0`` gives a
    ``StaticLossScaler`` of that scale; ``loss_scale == 0`` a ``DynamicLossScaler`` starting at
    ``2 ** initial_scale_power`` with ``loss_scale_window``, ``hysteresis`` (as
    ``delayed_shift``), ``consecutive_hysteresis`` and ``min_loss_scale``.
    ``hysteresis=False``: every overflow lowers the scale (``fp16.hysteresis`` is read but not
    applied), as DeepSpeed's ZeRO-0 fp16 optimizers (``FP16_Optimizer`` and the unfused one)
    do; its ZeRO 1-3 optimizers apply it.
    """
    loss_scale = _config_value(fp16_config, "loss_scale")
    if (
        isinstance(loss_scale, bool)
        or not isinstance(loss_scale, numbers.Real)
        or not math.isfinite(loss_scale)
        or loss_scale < 0
    ):
        raise ValueError(
            f"fp16.loss_scale must be a finite number >= 0 (0 selects dynamic scaling), "
            f"got {loss_scale!r}"
        )
    if loss_scale > 0:
        return StaticLossScaler(float(loss_scale))

    power = _config_value(fp16_config, "initial_scale_power")
    # Within float32's normal range, so every scale is exact and finite.
    if (
        isinstance(power, bool)
        or not isinstance(power, numbers.Integral)
        or not -126 <= power <= 127
    ):
        raise ValueError(
            f"fp16.initial_scale_power must be an integer in [-126, 127], got {power!r}"
        )
    window = _config_value(fp16_config, "loss_scale_window")
    delayed_shift = _config_value(fp16_config, "hysteresis")
    consecutive = _config_value(fp16_config, "consecutive_hysteresis")
    min_loss_scale = _config_value(fp16_config, "min_loss_scale")
    init_scale = 2.0 ** int(power)
    min_loss_scale = _positive_finite("fp16.min_loss_scale", min_loss_scale)
    if min_loss_scale > init_scale:
        raise ValueError(
            f"fp16.min_loss_scale ({min_loss_scale!r}) must be <= 2 ** fp16.initial_scale_power "
            f"({init_scale!r})"
        )
    return DynamicLossScaler(
        init_scale=init_scale,
        scale_window=_int_at_least("fp16.loss_scale_window", window, 1),
        min_scale=min_loss_scale,
        delayed_shift=_int_at_least("fp16.hysteresis", delayed_shift, 1) if hysteresis else 1,
        consecutive_hysteresis=_boolean("fp16.consecutive_hysteresis", consecutive),
        raise_error_at_min_scale=raise_error_at_min_scale,
    )
