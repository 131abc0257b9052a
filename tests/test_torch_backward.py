"""Torch-style backward (``runtime/torch_backward.py``) on real 2-rank gloo engines: a
``loss.backward()`` on (a function of) the engine's output, then ``engine.step()``, trains
exactly as ``engine.backward(loss); engine.step()`` does, pairwise over stage x precision x
accumulation steps:

- through the engine's output: the hooks divide by the accumulation steps (also the gradients
  of a reentrant checkpoint's segment, back-propagated in a nested graph task); under fp16 the
  loss comes through ``engine.scale(loss)`` (a loss scale of 256, so nothing rounds);
- two engines in one process trained by one shared loss (DeepSpeed's multiple-model test):
  through ``engine.module`` plus ``_backward_epilogue()`` (gradients taken as they are: the
  reference backward is ``engine.backward(loss / loss scale)``), and through the engines;
- refusals: ZeRO-0 through the engine's output, fp16 without ``engine.scale``; a step with no
  backward, or after a ``_backward_epilogue()`` with no backward, still raises.
Both sides of each comparison are engines built from the same seed in the same process, fed
the same fresh random batches; parameters compared bitwise after three optimizer steps (fp16
with accumulation: within 1e-6, see the test).
"""

from __future__ import annotations

import torch

STEPS = 3


class LossAndOutput(torch.nn.Module):
    """Returns (loss, output) as a Hugging Face model does (its loss and the logits it came
    from): a backward through the loss reaches the output from inside the model."""

    def __init__(self, reentrant: bool = False):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)
        )
        self.reentrant = reentrant

    def forward(self, x, y=None):
        if self.reentrant:  # its backward runs as a graph task nested in the outer one
            from torch.utils.checkpoint import checkpoint

            out = checkpoint(self.net[1:], self.net[0](x), use_reentrant=True)
        else:
            out = self.net(x)
        return out if y is None else (_loss(out, y), out)


def _model(seed: int, reentrant: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    return LossAndOutput(reentrant)


def _config(stage: int, precision: str, gas: int) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:  # every parameter partitioned, gathered by the hooks (none kept whole)
        config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8}
    elif precision == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _loss(output, target):
    return torch.nn.functional.mse_loss(output.float(), target)


def _engines(count: int, case: dict) -> list:
    import deepspeed_cpp

    config = _config(case["stage"], case["precision"], case["gas"])
    reentrant = case.get("reentrant", False)
    return [
        deepspeed_cpp.initialize(model=_model(case["seed"] + i, reentrant), config=config)[0]
        for i in range(count)
    ]


def _params(engines) -> list[torch.Tensor]:
    from deepspeed_cpp.zero import GatheredParameters

    out = []
    for engine in engines:
        params = list(engine.module.parameters())
        with GatheredParameters(params):
            out += [p.detach().float().clone() for p in params]
    return out


def _half(x, engine):
    return x.half() if engine.fp16_enabled() else x.bfloat16() if engine.bfloat16_enabled() else x


def _train(case: dict, batches) -> dict:
    """Trains ``case["engines"]`` engines two ways, side by side; returns both parameter lists."""
    gas, style = case["gas"], case["style"]
    count = case["engines"]
    reference = _engines(count, case)
    ours = _engines(count, case)
    for x, y in batches[: STEPS * gas]:
        # Reference: engine.backward of each engine's share of the shared loss.
        for i, engine in enumerate(reference):
            share = _loss(engine(_half(x, engine)), y) / (i + 1)
            if style == "module" and engine.fp16_enabled():
                share = share / engine.loss_scaler.loss_scale  # taken as loss-scaled
            engine.backward(share)
            engine.step()
        if style == "loss_output":  # the model's own loss, with its output beside it
            total = sum(ours[i](_half(x, ours[i]), y)[0] / (i + 1) for i in range(count))
            total.backward()
        elif style == "engine":  # loss.backward() on the engines' outputs
            total = sum(
                engine.scale(_loss(engine(_half(x, engine)), y) / (i + 1))
                for i, engine in enumerate(ours)
            )
            total.backward()
        else:  # DeepSpeed's multiple-model test: engine.module, then _backward_epilogue()
            total = sum(
                _loss(engine.module(_half(x, engine)), y) / (i + 1) for i, engine in enumerate(ours)
            )
            total.backward()
            for engine in ours:
                engine._backward_epilogue()
        for engine in ours:
            engine.step()
    result = {
        "reference": _params(reference),
        "ours": _params(ours),
        "steps": [e.global_steps for e in ours],
        "scales": [e.loss_scaler.loss_scale for e in ours if e.loss_scaler is not None],
        # Parameter hooks (the division by the accumulation steps) on the engines that only
        # ever ran engine.backward: none, whatever the accumulation steps.
        "hooked_by_engine_backward": [
            e._torch_backward._param_hooks is not None for e in reference
        ],
        "hooked_by_torch_backward": [e._torch_backward._param_hooks is not None for e in ours],
    }
    for engine in reference + ours:
        engine.destroy()
    return result


def _case(seed: int, stage: int, precision: str) -> dict:
    return dict(seed=seed, stage=stage, precision=precision, gas=1)


def _refusals(seed: int, x, y) -> dict:
    from deepspeed_cpp.runtime.call_order import StepWithoutBackwardError
    from deepspeed_cpp.runtime.torch_backward import TorchBackwardError

    out = {}
    (stage0,) = _engines(1, _case(seed, 0, "fp32"))
    try:
        _loss(stage0(x), y).backward()
    except TorchBackwardError as error:
        out["stage0"] = str(error)
    stage0.destroy()
    (fp16,) = _engines(1, _case(seed, 1, "fp16"))
    try:
        _loss(fp16(x.half()), y).backward()
    except TorchBackwardError as error:
        out["fp16"] = str(error)
    fp16.destroy()
    (engine,) = _engines(1, _case(seed, 2, "fp32"))
    for name in ("no_backward", "epilogue_only"):
        engine(x)
        if name == "epilogue_only":
            engine._backward_epilogue()  # no backward ran: nothing counts
        try:
            engine.step()
        except StepWithoutBackwardError as error:
            out[name] = str(error)
    # After a torch-style backward the step goes through, once.
    _loss(engine(x), y).backward()
    engine._backward_epilogue()  # void: the epilogue ran by itself
    engine.step()
    out["stepped"] = engine.global_steps
    try:
        engine.step()
    except StepWithoutBackwardError as error:
        out["second_step"] = str(error)
    engine.destroy()
    return out


def _job(cases, batches, refusal_inputs):
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = batches[rank]
    results = [_train(case, mine) for case in cases]
    return results, _refusals(cases[0]["seed"], *refusal_inputs[rank])


# Pairwise over stage x precision x accumulation steps x style, plus two engines in one process.
CASES = [
    dict(stage=1, precision="fp16", gas=2, style="engine", engines=1),
    dict(stage=2, precision="bf16", gas=1, style="engine", engines=1),
    dict(stage=3, precision="fp32", gas=2, style="engine", engines=1),
    dict(stage=2, precision="fp32", gas=2, style="engine", engines=2),
    dict(stage=1, precision="fp32", gas=4, style="loss_output", engines=1),
    dict(stage=3, precision="fp16", gas=1, style="module", engines=2),
    dict(stage=1, precision="bf16", gas=1, style="module", engines=2),
    dict(stage=0, precision="fp32", gas=1, style="module", engines=1),
    # A reentrant checkpoint in the model: its parameters' gradients are divided too.
    dict(stage=1, precision="fp32", gas=2, style="engine", engines=1, reentrant=True),
    dict(stage=3, precision="bf16", gas=4, style="loss_output", engines=1, reentrant=True),
]


def test_torch_style_backward_equals_engine_backward(pool2):
    seed = int(torch.randint(0, 2**31, ()))
    cases = [dict(case, seed=seed) for case in CASES]
    batches = [[(torch.randn(2, 6), torch.randn(2, 3)) for _ in range(STEPS * 4)] for _ in range(2)]
    refusal_inputs = [(torch.randn(2, 6), torch.randn(2, 3)) for _ in range(2)]
    for results, refusals in pool2.run(_job, cases, batches, refusal_inputs):
        for case, result in zip(cases, results):
            assert result["steps"] == [STEPS] * case["engines"], (case, result["steps"])
            assert result["scales"] in ([], [256.0] * case["engines"]), case
            # fp16 at gas > 1: engine.backward runs the model's backward at half the scale of
            # engine.scale(loss) (divided later, at the parameters): equal unless an fp16
            # gradient element is subnormal at one of the two scales.
            atol = 1e-6 if case["precision"] == "fp16" and case["gas"] > 1 else 0.0
            for ref, got in zip(result["reference"], result["ours"], strict=True):
                assert torch.allclose(ref, got, rtol=0.0, atol=atol), (
                    case,
                    (ref - got).abs().max(),
                )
            # The per-parameter division hooks: only where a torch-style backward through the
            # engine divides (accumulation steps > 1), never for engine.backward alone.
            divides = case["style"] != "module" and case["gas"] > 1
            assert result["hooked_by_torch_backward"] == [divides] * case["engines"], case
            assert not any(result["hooked_by_engine_backward"]), case
            moved = _model(seed).net[0].weight.detach()
            assert not torch.equal(result["ours"][0], moved), case  # it trained
        assert "Direct calls to tensor.backward() are not supported" in refusals["stage0"]
        assert "ZeRO stage 0" in refusals["stage0"]
        assert "Loss scaling is required" in refusals["fp16"]
        assert "engine.scale(loss).backward()" in refusals["fp16"]
        assert "no engine.backward()" in refusals["no_backward"]
        assert "no engine.backward()" in refusals["epilogue_only"]
        assert refusals["stepped"] == 1
        assert "no engine.backward()" in refusals["second_step"]
