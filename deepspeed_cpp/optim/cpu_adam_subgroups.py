"""``DeepSpeedCPUAdam.step_subgroup`` / ``rollback_subgroup``: DeepSpeed's per-sub-group steps.

DeepSpeed's ZeRO-3 offload steps one flat sub-group at a time and keeps its Adam state under the
sub-group's index (``optimizer.state[sub_group_id]``) rather than under the parameter; a step that
must be undone (an overflow found after some sub-groups stepped) is rolled back by inverting the
update from the state it produced. Both are public methods of DeepSpeed's CPU Adam; code written
for that layout (one parameter with a gradient per call, the current sub-group's flat tensor)
runs on ours through them. The update is the native op's (``cpu_adam_step_multi``); the rollback
inverts it in float32. Like DeepSpeed's, the inverse recovers ``exp_avg_sq`` by a subtraction:
where a step's gradient was far smaller than a later one's, that loses precision.
"""

from __future__ import annotations

import torch

from ..ops.cpu_adam import cpu_adam_step_multi


def _the_stepped_param(optimizer, what: str):
    stepped = [
        (group, p)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    if len(stepped) != 1:
        raise RuntimeError(
            f"DeepSpeedCPUAdam.{what}: {len(stepped)} parameters have a gradient; a sub-group "
            f"step expects exactly one (the sub-group's flat parameter), as in DeepSpeed's layout"
        )
    group, param = stepped[0]
    if param.device.type != "cpu":
        raise RuntimeError(
            f"DeepSpeedCPUAdam.{what}: the parameter is on {param.device}; expected a CPU tensor "
            f"(enable 'offload_optimizer': 'cpu' in the ZeRO config)"
        )
    return group, param


def _bias_corrections(group, step: int) -> tuple[float, float]:
    beta1, beta2 = group["betas"]
    if not group["bias_correction"]:
        return 1.0, 1.0
    return 1.0 - beta1**step, 1.0 - beta2**step


class SubgroupSteps:
    """The sub-group methods of ``DeepSpeedCPUAdam`` (a mixin; see the module docstring)."""

    @torch.no_grad()
    def step_subgroup(self, subgroup_id: int, closure=None):
        """One Adam step of the one parameter with a gradient, with the state of
        ``subgroup_id`` (created at the first call)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group, param = _the_stepped_param(self, "step_subgroup")
        state = self.state[subgroup_id]
        if len(state) == 0:
            state["step"] = 0
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(param, dtype=self._state_dtype(param))
        state["step"] += 1
        beta1, beta2 = group["betas"]
        cpu_adam_step_multi(
            [param.data], [param.grad.data], [state["exp_avg"]], [state["exp_avg_sq"]],
            step=state["step"], lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
            adamw_mode=group["adamw_mode"],
        )  # fmt: skip
        return loss

    @torch.no_grad()
    def rollback_subgroup(self, sub_group_id: int, closure=None):
        """Undoes the last ``step_subgroup(sub_group_id)`` made with the current gradient:
        parameter, ``exp_avg`` and ``exp_avg_sq`` return to their values before it (up to
        rounding) and ``step`` goes down by one."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        state = self.state.get(sub_group_id) if sub_group_id in self.state else None
        if not state:
            raise RuntimeError(
                f"Cannot rollback optimizer state for sub_group_id {sub_group_id} as it has not "
                f"been initialized (no step_subgroup({sub_group_id}) yet)"
            )
        if state.get("step", 0) <= 0:
            raise RuntimeError(
                f"Cannot rollback sub_group_id {sub_group_id}: step count is {state.get('step', 0)}"
            )
        group, param = _the_stepped_param(self, "rollback_subgroup")
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        correction1, correction2 = _bias_corrections(group, state["step"])
        m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
        update = (m / correction1) / ((v / correction2).sqrt() + eps)
        p = param.data.float()
        if group["adamw_mode"]:  # p_new = p (1 - lr decay) - lr update
            p = (p + lr * update) / (1.0 - lr * decay) if lr * decay != 1.0 else p + lr * update
            g = param.grad.float()
        else:  # the decay went into the gradient: g' = g + decay p_old
            p = p + lr * update
            g = param.grad.float() + decay * p
        state["exp_avg"].copy_((m - (1.0 - beta1) * g) / beta1)
        state["exp_avg_sq"].copy_(((v - (1.0 - beta2) * g * g) / beta2).clamp_min(0.0))
        param.data.copy_(p)
        state["step"] -= 1
        return loss
