"""DeepSpeedCPUAdagrad: Adagrad on CPU tensors through the native cpu_adagrad op."""

from __future__ import annotations

from ..ops.cpu_adagrad import cpu_adagrad_step_multi, load_cpu_adagrad
from .cpu_optimizer_base import CPUOptimizerBase


class DeepSpeedCPUAdagrad(CPUOptimizerBase):
    """Adagrad as ``torch.optim.Adagrad`` defines it, on CPU tensors, with DeepSpeed's constructor.

    ``lr_decay`` and ``initial_accumulator_value`` are torch's (DeepSpeed has neither: leave them
    at 0). Parameters are float32, bfloat16 or float16; the arithmetic is float32; the state
    (``sum``, torch's name) is float32 unless ``fp32_optimizer_states=False`` keeps it in
    bfloat16 for bfloat16 parameters. State dicts load into and from ``torch.optim.Adagrad``.

    A sparse gradient (``nn.Embedding(sparse=True)``) updates only the rows it holds, and their
    ``sum``, as torch's Adagrad does; ``weight_decay`` then decays those rows only, as
    DeepSpeed's CPU Adagrad does (torch refuses weight decay with sparse gradients).
    """

    STATE_KEYS = ("sum",)
    SPARSE_GRADIENTS = True  # DeepSpeed's CPU Adagrad steps only the rows a sparse gradient holds

    def __init__(
        self,
        model_params,
        lr: float = 1e-2,
        eps: float = 1e-10,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
        lr_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
    ):
        if amsgrad:
            raise ValueError("DeepSpeedCPUAdagrad does not implement amsgrad=True")
        for name, value in (
            ("lr", lr),
            ("eps", eps),
            ("weight_decay", weight_decay),
            ("lr_decay", lr_decay),
            ("initial_accumulator_value", initial_accumulator_value),
        ):
            if not value >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        defaults = dict(
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            lr_decay=lr_decay,
            initial_accumulator_value=initial_accumulator_value,
            amsgrad=False,
        )
        super().__init__(model_params, defaults, fp32_optimizer_states)
        load_cpu_adagrad()

    def _initial_state_value(self, group, key: str) -> float:
        return group["initial_accumulator_value"]

    def _native_step(self, group, step, params, grads, states, params_lowp) -> None:
        cpu_adagrad_step_multi(
            params,
            grads,
            states[0],
            step=step,
            lr=group["lr"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            lr_decay=group["lr_decay"],
            params_lowp=params_lowp,
        )

    def load_state_dict(self, state_dict) -> None:
        """Loads our own state dicts and those of torch.optim.Adagrad."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.setdefault("lr_decay", 0.0)
            group.setdefault("initial_accumulator_value", 0.0)
