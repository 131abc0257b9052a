"""DeepSpeedCPULion: Lion on CPU tensors through the native cpu_lion op."""

from __future__ import annotations

from ..ops.cpu_lion import cpu_lion_step_multi, load_cpu_lion
from .cpu_optimizer_base import CPUOptimizerBase


class DeepSpeedCPULion(CPUOptimizerBase):
    """Lion (Chen et al., 2023) on CPU tensors, with DeepSpeed's constructor.

    ``update = sign(beta1 * exp_avg + (1 - beta1) * grad)``;
    ``param = param * (1 - lr * weight_decay) - lr * update``;
    ``exp_avg = beta2 * exp_avg + (1 - beta2) * grad``. Parameters are float32, bfloat16 or
    float16; the arithmetic is float32; the state (``exp_avg``) is float32 unless
    ``fp32_optimizer_states=False`` keeps it in bfloat16 for bfloat16 parameters.
    """

    STATE_KEYS = ("exp_avg",)

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        fp32_optimizer_states: bool = True,
    ):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0, got {lr!r}")
        if len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        for index, beta in enumerate(betas):
            if not 0.0 <= beta <= 1.0:
                raise ValueError(f"betas[{index}] must be in [0, 1], got {beta!r}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(model_params, defaults, fp32_optimizer_states)
        load_cpu_lion()

    def _native_step(self, group, step, params, grads, states, params_lowp) -> None:
        beta1, beta2 = group["betas"]
        cpu_lion_step_multi(
            params,
            grads,
            states[0],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            params_lowp=params_lowp,
        )
