"""``DeepSpeedCPUAdam.step_subgroup`` / ``rollback_subgroup`` (DeepSpeed's per-sub-group steps):
each sub-group's state steps like torch's Adam/AdamW on that sub-group's own history, and a
rollback returns parameter and state to their values before the last step."""

from __future__ import annotations

import random

import pytest
import torch

from deepspeed_cpp.ops.adam import DeepSpeedCPUAdam


def _away_from_zero(n: int) -> torch.Tensor:
    return torch.empty(n).uniform_(0.5, 2.0) * torch.randint(0, 2, (n,)).mul(2).sub(1)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_subgroups_step_like_torch_and_roll_back(adamw_mode):
    n, steps = random.randint(40, 300), random.randint(2, 4)
    hyper = dict(lr=random.uniform(1e-3, 1e-1), betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    starts = [torch.randn(n), torch.randn(n)]
    # Gradients of magnitude 0.5-2: undoing a step recovers exp_avg_sq by a subtraction that
    # loses float32 precision where an earlier gradient was far smaller than a later one (in
    # DeepSpeed's rollback too); away from that the inverse must be tight.
    grads = [[_away_from_zero(n) for _ in range(steps)] for _ in starts]
    torch_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    param = torch.nn.Parameter(starts[0].clone())
    ours = DeepSpeedCPUAdam([param], adamw_mode=adamw_mode, **hyper)
    params = [param, torch.nn.Parameter(starts[1].clone())]
    history = {0: [], 1: []}
    for step in range(steps):
        for sub in (0, 1):  # two sub-groups take turns: each keeps its own state
            ours.param_groups[0]["params"] = [params[sub]]
            params[sub].grad = grads[sub][step].clone()
            state = {k: v.clone() for k, v in ours.state[sub].items() if torch.is_tensor(v)}
            history[sub].append((params[sub].detach().clone(), state))
            ours.step_subgroup(sub)
            assert ours.state[sub]["step"] == step + 1
    for sub in (0, 1):
        reference = torch.nn.Parameter(starts[sub].clone())
        torch_opt = torch_class([reference], **hyper)
        for grad in grads[sub]:
            reference.grad = grad.clone()
            torch_opt.step()
        torch.testing.assert_close(params[sub].detach(), reference.detach(), rtol=1e-5, atol=1e-6)
        torch_state = torch_opt.state[reference]
        torch.testing.assert_close(ours.state[sub]["exp_avg_sq"], torch_state["exp_avg_sq"])
    # Roll sub-group 1 back step by step, with the gradient each step used.
    ours.param_groups[0]["params"] = [params[1]]
    for step in reversed(range(steps)):
        params[1].grad = grads[1][step].clone()
        ours.rollback_subgroup(1)
        before, state_before = history[1][step]
        torch.testing.assert_close(params[1].detach(), before, rtol=1e-4, atol=1e-5)
        for key, value in state_before.items():
            torch.testing.assert_close(ours.state[1][key], value, rtol=1e-4, atol=1e-5)
        assert ours.state[1]["step"] == step
    assert ours.state[0]["step"] == steps  # the other sub-group is untouched
    with pytest.raises(RuntimeError, match="Cannot rollback sub_group_id 1: step count is 0"):
        ours.rollback_subgroup(1)
    with pytest.raises(RuntimeError, match="sub_group_id 7 as it has not been initialized"):
        ours.rollback_subgroup(7)
    ours.param_groups[0]["params"] = params
    with pytest.raises(RuntimeError, match="2 parameters have a gradient; a sub-group step"):
        ours.step_subgroup(0)
