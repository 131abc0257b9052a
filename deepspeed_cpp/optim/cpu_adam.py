"""DeepSpeedCPUAdam: Adam/AdamW on CPU tensors through the native cpu_adam op."""

from __future__ import annotations

from ..ops.cpu_adam import cpu_adam_step_multi, load_cpu_adam
from .cpu_adam_subgroups import SubgroupSteps
from .cpu_optimizer_base import CPUOptimizerBase
from .torch_adam_state import complete_adam_group, refuse_unsupported_adam_flags


def check_adam_hyper_params(lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
    """Raises ValueError naming the first hyper-parameter outside its valid range."""
    if not lr >= 0.0:
        raise ValueError(f"lr must be >= 0, got {lr!r}")
    if len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for index, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{index}] must be in [0, 1), got {beta!r}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if not weight_decay >= 0.0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")


class DeepSpeedCPUAdam(SubgroupSteps, CPUOptimizerBase):
    """Adam (``adamw_mode=False``: L2 added to the gradient) or AdamW (decoupled weight decay).

    The constructor is DeepSpeed's. Parameters are float32, bfloat16 or float16 CPU tensors; the
    arithmetic is float32. The state is float32 unless ``fp32_optimizer_states=False``, which
    keeps it in bfloat16 for bfloat16 parameters. State uses torch's names (``step``,
    ``exp_avg``, ``exp_avg_sq``), so state dicts move between this optimizer and
    ``torch.optim.Adam``/``AdamW`` in both directions. Each param group may set its own ``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``bias_correction`` and ``adamw_mode``.
    ``step(fp16_param_groups=...)`` also writes low-precision copies of float32 parameters.
    ``step_subgroup``/``rollback_subgroup``: DeepSpeed's per-sub-group steps
    (``cpu_adam_subgroups.py``).
    """

    STATE_KEYS = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        model_params,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
    ):
        if amsgrad:
            raise ValueError(
                "DeepSpeedCPUAdam does not implement amsgrad=True; use torch.optim.AdamW("
                "amsgrad=True) for that variant"
            )
        check_adam_hyper_params(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            adamw_mode=adamw_mode,
            amsgrad=False,
        )
        super().__init__(model_params, defaults, fp32_optimizer_states)
        for group in self.param_groups:
            check_adam_hyper_params(
                group["lr"], group["betas"], group["eps"], group["weight_decay"]
            )
        load_cpu_adam()

    @property
    def adam_w_mode(self) -> bool:
        """DeepSpeed's attribute name for the optimizer's default ``adamw_mode``."""
        return self.defaults["adamw_mode"]

    def _native_step(self, group, step, params, grads, states, params_lowp) -> None:
        beta1, beta2 = group["betas"]
        exp_avgs, exp_avg_sqs = states
        cpu_adam_step_multi(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=step,
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            bias_correction=group["bias_correction"],
            adamw_mode=group["adamw_mode"],
            params_lowp=params_lowp,
        )

    def load_state_dict(self, state_dict) -> None:
        """Loads our own state dicts and those of torch.optim.Adam / AdamW."""
        refuse_unsupported_adam_flags(state_dict, "DeepSpeedCPUAdam")
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            complete_adam_group(group, "adamw_mode", self.defaults["adamw_mode"])
