"""Calls DeepSpeed's API refuses (or that would train silently wrong), on 2 real gloo ranks,
and the legitimate patterns beside them that must keep working."""

from __future__ import annotations

import pytest
import torch


def _config(stage: int, gas: int = 1) -> dict:
    return {
        "gradient_clipping": 0.0,
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))


def _batch():
    return torch.randn(2, 4), torch.randn(2, 2)


def _foreign_parameters_job(stage: int):
    import deepspeed_cpp
    from deepspeed_cpp.runtime.call_order import ForeignParameterError

    messages = []
    stranger = torch.nn.Parameter(torch.zeros(3, 5))
    for given in ([stranger], [{"params": [stranger], "weight_decay": 0.0}]):
        try:
            deepspeed_cpp.initialize(model=_model(), model_parameters=given, config=_config(stage))
        except ForeignParameterError as error:
            messages.append(str(error))
    model = _model()  # a client optimizer over a parameter the model does not hold
    optimizer = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    config = {k: v for k, v in _config(stage).items() if k != "optimizer"}
    try:
        deepspeed_cpp.initialize(model=model, optimizer=optimizer, config=config)
    except ForeignParameterError as error:
        messages.append(str(error))
    return messages


@pytest.mark.parametrize("stage", [1, 3])
def test_model_parameters_must_be_the_models(pool2, stage):
    for messages in pool2.run(_foreign_parameters_job, stage):
        assert len(messages) == 3, messages
        first, grouped, client = messages
        assert "model_parameters[0]" in first and "shape (3, 5)" in first, first
        assert "is not a parameter of the model" in first
        assert "model_parameters[0]['params'][0]" in grouped, grouped
        assert "the optimizer's param_groups[0]['params'][4]" in client, client


def _call_order_job(stage: int):
    import deepspeed_cpp
    from deepspeed_cpp.runtime.call_order import (
        BackwardWithoutForwardError,
        StepWithoutBackwardError,
    )

    engine, *_ = deepspeed_cpp.initialize(model=_model(), config=_config(stage))
    x, y = _batch()
    outcome = {}
    try:  # a fresh engine: no forward yet
        engine.backward(torch.ones((), requires_grad=True) * 2.0)
    except BackwardWithoutForwardError as error:
        outcome["backward_first"] = str(error)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    before = {n: v.clone() for n, v in engine.full_module_state_dict().items()}
    try:  # a second step after the one backward
        engine.step()
    except StepWithoutBackwardError as error:
        outcome["step_again"] = str(error)
    after = engine.full_module_state_dict()
    outcome["unchanged"] = all(torch.equal(after[n], v) for n, v in before.items())
    outcome["global_steps"] = engine.global_steps
    stale = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(stale)
    engine.step()
    try:  # a loss from before the last step: no forward since
        engine.backward(stale * 1.0)
    except BackwardWithoutForwardError as error:
        outcome["backward_after_step"] = str(error)
    except RuntimeError as error:  # autograd's own (the graph was freed) would be wrong here
        outcome["backward_after_step"] = f"autograd: {error}"
    return outcome


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_step_needs_a_backward_and_backward_needs_a_forward(pool2, stage):
    for outcome in pool2.run(_call_order_job, stage):
        assert "no forward of the model ran" in outcome["backward_first"], outcome
        assert "no engine.backward() since the last engine.step()" in outcome["step_again"]
        assert "global step 1" in outcome["step_again"], outcome
        assert outcome["unchanged"] and outcome["global_steps"] == 1, outcome
        assert "no forward of the model ran" in outcome["backward_after_step"], outcome


def _legitimate_patterns_job(stage: int):
    """Gradient accumulation (step() every micro-step), two backwards after one forward,
    a forward through engine.module, and a checkpoint loaded between steps."""
    import tempfile

    import torch.distributed as dist

    import deepspeed_cpp

    engine, *_ = deepspeed_cpp.initialize(model=_model(), config=_config(stage, gas=2))
    for _ in range(4):
        x, y = _batch()
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    x, y = _batch()
    out = engine(x)
    engine.backward(torch.nn.functional.mse_loss(out, y), retain_graph=True)
    engine.backward(out.pow(2).mean())
    engine.step()
    engine.backward(torch.nn.functional.mse_loss(engine.module(x), y))
    engine.step()
    folder = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    engine.save_checkpoint(folder[0])
    engine.load_checkpoint(folder[0])
    for _ in range(2):
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    return engine.global_steps, engine.micro_steps


@pytest.mark.parametrize("stage", [1, 3])
def test_legitimate_call_patterns_still_work(pool2, stage):
    for global_steps, micro_steps in pool2.run(_legitimate_patterns_job, stage):
        assert (global_steps, micro_steps) == (4, 8)
