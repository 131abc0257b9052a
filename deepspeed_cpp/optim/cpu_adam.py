"""DeepSpeedCPUAdam: Adam/AdamW on CPU tensors through the native cpu_adam op."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..ops.cpu_adam import cpu_adam_step_multi, load_cpu_adam


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


class DeepSpeedCPUAdam(torch.optim.Optimizer):
    """Adam (``adamw_mode=False``: L2 added to the gradient) or AdamW (decoupled weight decay).

    The constructor is DeepSpeed's. Parameters must be float32 CPU tensors. State uses torch's
    names (``step``, ``exp_avg``, ``exp_avg_sq``), so state dicts move between this optimizer and
    ``torch.optim.Adam``/``AdamW`` in both directions. Each param group may set its own ``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``bias_correction`` and ``adamw_mode``.
    """

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
        super().__init__(model_params, defaults)
        # Kept for DeepSpeed compatibility: with float32 parameters the state is float32 anyway.
        self.fp32_optimizer_states = fp32_optimizer_states
        for group_index, group in enumerate(self.param_groups):
            check_adam_hyper_params(
                group["lr"], group["betas"], group["eps"], group["weight_decay"]
            )
            for param_index, param in enumerate(group["params"]):
                _check_param(param, group_index, param_index)
        load_cpu_adam()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group_index, group in enumerate(self.param_groups):
            # One native call per distinct step count (normally exactly one per group).
            batches: dict[int, tuple[list, list, list, list]] = defaultdict(
                lambda: ([], [], [], [])
            )
            for param_index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                _check_param(param, group_index, param_index)
                if param.grad.is_sparse:
                    raise RuntimeError(
                        f"DeepSpeedCPUAdam does not support sparse gradients (param {param_index} "
                        f"of group {group_index})"
                    )
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(
                        param, memory_format=torch.contiguous_format
                    )
                    state["exp_avg_sq"] = torch.zeros_like(
                        param, memory_format=torch.contiguous_format
                    )
                # A new tensor, not +=: loaded state dicts share step tensors with their source.
                state["step"] = state["step"] + 1
                params, grads, exp_avgs, exp_avg_sqs = batches[int(state["step"].item())]
                params.append(param)
                grads.append(param.grad.contiguous())
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
            beta1, beta2 = group["betas"]
            for step, (params, grads, exp_avgs, exp_avg_sqs) in batches.items():
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
                )
        return loss

    def load_state_dict(self, state_dict) -> None:
        """Loads our own state dicts and those of torch.optim.Adam / AdamW."""
        for index, group in enumerate(state_dict["param_groups"]):
            for flag in ("amsgrad", "maximize"):
                if group.get(flag):
                    raise ValueError(
                        f"cannot load a state dict whose param group {index} has {flag}=True: "
                        f"DeepSpeedCPUAdam does not implement it"
                    )
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if "adamw_mode" not in group:
                # torch.optim.Adam records decoupled_weight_decay=False, AdamW True.
                group["adamw_mode"] = bool(
                    group.get("decoupled_weight_decay", self.defaults["adamw_mode"])
                )
            group.setdefault("bias_correction", True)
            group["betas"] = tuple(group["betas"])
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].contiguous()
            if "step" in state and not torch.is_tensor(state["step"]):
                state["step"] = torch.tensor(float(state["step"]))


def _check_param(param: torch.Tensor, group_index: int, param_index: int) -> None:
    where = f"param {param_index} of group {group_index}"
    if param.device.type != "cpu":
        raise ValueError(f"DeepSpeedCPUAdam needs CPU parameters; {where} is on {param.device}")
    if param.dtype != torch.float32:
        raise TypeError(
            f"DeepSpeedCPUAdam needs float32 parameters; {where} is {param.dtype} "
            f"(keep an fp32 master copy and copy it out to low precision)"
        )
    if not param.is_contiguous():
        raise ValueError(
            f"DeepSpeedCPUAdam needs contiguous parameters; {where} has shape "
            f"{tuple(param.shape)} and strides {param.stride()}"
        )
