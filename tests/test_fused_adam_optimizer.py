"""deepspeed_cpp.optim.FusedAdam on CPU tensors (through cpu_adam): training against torch, groups,
state dicts, zero_grad, DeepSpeed's constructor, bad input, and the message when the CUDA op
cannot be had. Its CUDA path is tested in test_fused_adam_cuda.py (GPU) and, without a GPU, on
fake CUDA tensors against the pre-built library in test_fused_adam_build.py."""

import copy
import inspect
import os
import subprocess
import sys

import pytest
import torch
from adam_reference import storage_ulp

from deepspeed_cpp.optim import DeepSpeedCPUAdam, FusedAdam


def _model():
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 5))


def _batches(n=20):
    return [(torch.randn(8, 13), torch.randn(8, 5)) for _ in range(n)]


def _backward(model, batch):
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()


def _train(model, optimizer, batches):
    for batch in batches:
        optimizer.zero_grad()
        _backward(model, batch)
        optimizer.step()


def test_constructor_is_deepspeeds():
    parameters = inspect.signature(FusedAdam).parameters
    assert list(parameters)[:9] == ["params", "lr", "bias_correction", "betas", "eps",
                                    "adam_w_mode", "weight_decay", "amsgrad",
                                    "set_grad_none"]  # fmt: skip
    defaults = {name: p.default for name, p in parameters.items()}
    assert defaults["lr"] == 1e-3 and defaults["bias_correction"] is True
    assert defaults["betas"] == (0.9, 0.999) and defaults["eps"] == 1e-8
    assert defaults["adam_w_mode"] is True and defaults["weight_decay"] == 0.0
    assert defaults["amsgrad"] is False and defaults["set_grad_none"] is True
    # Positional use as in DeepSpeed scripts.
    FusedAdam(_model().parameters(), 1e-3, True, (0.9, 0.99), 1e-8, False, 0.01)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_training_matches_torch_in_float64(adam_w_mode):
    ours = _model()
    reference = copy.deepcopy(ours).double()
    hp = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05)
    optimizer = FusedAdam(ours.parameters(), adam_w_mode=adam_w_mode, **hp)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    reference_optimizer = torch_cls(reference.parameters(), foreach=False, **hp)
    for batch in _batches():
        # Same float32 gradients to both, so only the update arithmetic differs.
        optimizer.zero_grad()
        _backward(ours, batch)
        for p, q in zip(ours.parameters(), reference.parameters()):
            q.grad = p.grad.double()
        optimizer.step()
        reference_optimizer.step()
    for p, q in zip(ours.parameters(), reference.parameters()):
        assert (p.double() - q).abs().max() <= 2e-6 * q.abs().max()


def test_cpu_path_equals_deepspeed_cpu_adam_bitwise():
    ours, theirs = _model(), _model()
    theirs.load_state_dict(ours.state_dict())
    hp = dict(lr=3e-3, betas=(0.85, 0.99), eps=1e-6, weight_decay=0.02)
    optimizer = FusedAdam(ours.parameters(), **hp)
    cpu_adam = DeepSpeedCPUAdam(theirs.parameters(), adamw_mode=True, **hp)
    for batch in _batches(5):
        _train(ours, optimizer, [batch])
        _train(theirs, cpu_adam, [batch])
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(p, q)


def test_param_groups_with_their_own_hyper_parameters():
    model = _model()
    reference = copy.deepcopy(model).double()
    groups = [
        dict(params=list(model[0].parameters()), lr=2e-2, weight_decay=0.1),
        dict(params=list(model[2].parameters()), betas=(0.8, 0.9), adam_w_mode=False,
             bias_correction=True),
    ]  # fmt: skip
    optimizer = FusedAdam(groups, lr=1e-3, weight_decay=0.0)
    reference_optimizers = [
        torch.optim.AdamW(reference[0].parameters(), lr=2e-2, weight_decay=0.1, foreach=False),
        torch.optim.Adam(reference[2].parameters(), lr=1e-3, betas=(0.8, 0.9), foreach=False),
    ]
    for batch in _batches(10):
        optimizer.zero_grad()
        _backward(model, batch)
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.double()
        optimizer.step()
        for ref in reference_optimizers:
            ref.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.double() - q).abs().max() <= 2e-6 * q.abs().max()


def test_without_bias_correction_matches_the_formula():
    param = torch.nn.Parameter(torch.randn(101))
    start = param.detach().clone().double()
    lr, beta1, beta2, eps, wd = 1e-2, 0.9, 0.99, 1e-8, 0.1
    optimizer = FusedAdam([param], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=wd,
                          bias_correction=False)  # fmt: skip
    p, m, v = start, torch.zeros_like(start), torch.zeros_like(start)
    for _ in range(10):
        grad = torch.randn(101)
        param.grad = grad
        optimizer.step()
        g = grad.double()
        p = p * (1 - lr * wd)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * m / (v.sqrt() + eps)
    assert (param.double() - p).abs().max() <= 1e-6 * p.abs().max()


def test_lr_changed_between_steps_is_used():
    param = torch.nn.Parameter(torch.randn(17))
    reference = torch.nn.Parameter(param.detach().double().clone())
    optimizer = FusedAdam([param], lr=1e-2)
    reference_optimizer = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.0)
    for step in range(6):
        for opt in (optimizer, reference_optimizer):
            opt.param_groups[0]["lr"] = 1e-2 / (step + 1)
        grad = torch.randn(17)
        param.grad, reference.grad = grad, grad.double()
        optimizer.step()
        reference_optimizer.step()
    assert (param.double() - reference).abs().max() <= 2e-6 * reference.abs().max()


def test_state_dict_moves_to_and_from_torch_adamw():
    model, batches = _model(), _batches(12)
    hp = dict(lr=5e-3, weight_decay=0.01)
    optimizer = FusedAdam(model.parameters(), **hp)
    _train(model, optimizer, batches[:6])
    assert set(optimizer.state[model[0].weight]) == {"step", "exp_avg", "exp_avg_sq"}

    # ours -> torch: torch continues where we stopped, and the reverse.
    torch_model = copy.deepcopy(model)
    torch_optimizer = torch.optim.AdamW(torch_model.parameters(), foreach=False, **hp)
    # Deep copies: a loaded state dict shares the tensors of its source.
    torch_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    back_model = copy.deepcopy(model)
    back = FusedAdam(back_model.parameters(), **hp)
    back.load_state_dict(copy.deepcopy(torch_optimizer.state_dict()))
    for m_, opt in ((model, optimizer), (torch_model, torch_optimizer), (back_model, back)):
        _train(m_, opt, batches[6:])
    for p, q, r in zip(model.parameters(), torch_model.parameters(), back_model.parameters()):
        assert torch.equal(p, r)
        assert (p - q).abs().max() <= 1e-5 * q.abs().max()
    assert back.param_groups[0]["adam_w_mode"] is True


def test_state_dict_of_torch_adam_loads_as_l2_mode():
    model = _model()
    torch_optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=0.1)
    _train(model, torch_optimizer, _batches(2))
    optimizer = FusedAdam(model.parameters())
    optimizer.load_state_dict(torch_optimizer.state_dict())
    assert optimizer.param_groups[0]["adam_w_mode"] is False
    _train(model, optimizer, _batches(1))
    step = optimizer.state[model[0].weight]["step"]
    assert step.device.type == "cpu" and float(step) == 3.0


@pytest.mark.parametrize("set_grad_none", [True, False])
def test_zero_grad_follows_set_grad_none(set_grad_none):
    model = _model()
    optimizer = FusedAdam(model.parameters(), set_grad_none=set_grad_none)
    _backward(model, _batches(1)[0])
    optimizer.zero_grad()
    grad = model[0].weight.grad
    if set_grad_none:
        assert grad is None
    else:
        assert grad is not None and not grad.any()
    _backward(model, _batches(1)[0])
    optimizer.zero_grad(set_to_none=True)
    assert model[0].weight.grad is None


def test_params_without_grad_are_left_alone():
    model = _model()
    before = model[2].weight.detach().clone()
    optimizer = FusedAdam(model.parameters())
    _backward(model, _batches(1)[0])
    model[2].weight.grad = None
    optimizer.step()
    assert torch.equal(model[2].weight, before)
    assert model[2].weight not in optimizer.state


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(amsgrad=True), ValueError, "does not support the AMSGrad variant"),
        (dict(lr=-1.0), ValueError, "lr must be >= 0, got -1.0"),
        (dict(betas=(0.9, 1.0)), ValueError, r"betas\[1\] must be in \[0, 1\), got 1.0"),
        (dict(eps=-1e-8), ValueError, "eps must be >= 0"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0, got -0.1"),
        (dict(capturable=True), ValueError, "capturable=True\\) needs CUDA parameters; param 0 "
                                            "of group 0 is on cpu"),
    ],
)  # fmt: skip
def test_bad_constructor_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        FusedAdam(_model().parameters(), **kwargs)


def test_bad_parameters_are_named():
    with pytest.raises(TypeError, match="float32, bfloat16, float16 parameters on cpu; param 1 "
                                        "of group 0 is torch.float64"):  # fmt: skip
        FusedAdam([torch.nn.Parameter(torch.randn(3)),
                   torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])  # fmt: skip
    with pytest.raises(ValueError, match=r"param 0 of group 0 has shape \(4, 3\) and strides "):
        FusedAdam([torch.nn.Parameter(torch.randn(3, 4).t())])
    with pytest.raises(ValueError, match="CUDA or CPU parameters; param 0 of group 0 is on meta"):
        FusedAdam([torch.nn.Parameter(torch.empty(3, device="meta"))])


def test_sparse_gradients_are_refused():
    param = torch.nn.Parameter(torch.randn(4, 3))
    param.grad = torch.randn(4, 3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients \\(param 0 of group 0\\)"):
        FusedAdam([param]).step()


_UNAVAILABLE_SCRIPT = """
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from deepspeed_cpp.optim import FusedAdam
from deepspeed_cpp.ops.op_builder import OpNotAvailableError
with FakeTensorMode():
    param = torch.nn.Parameter(torch.empty(3, device="cuda"))
try:
    FusedAdam([param])
except OpNotAvailableError as error:
    print("MESSAGE:", error)
"""


def test_says_clearly_when_the_cuda_op_cannot_be_had(tmp_path):
    # Fake CUDA parameters (no GPU needed), and no toolkit to build the op with.
    env = dict(os.environ, CUDA_HOME=str(tmp_path), DS_CPP_EXTENSIONS_DIR=str(tmp_path / "jit"))
    result = subprocess.run([sys.executable, "-c", _UNAVAILABLE_SCRIPT], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "MESSAGE: FusedAdam has CUDA parameters but the fused_adam CUDA op is not available" in (
        result.stdout
    )
    assert f"CUDA_HOME={tmp_path} is not a CUDA toolkit" in result.stdout
    assert "DS_BUILD_FUSED_ADAM=1" in result.stdout


@pytest.mark.parametrize("available", [True, False])
def test_config_adam_on_cuda_parameters_picks_fused_adam_when_the_op_can_run(
    monkeypatch, available
):
    """The ds_config's Adam for CUDA parameters: our FusedAdam when the op can run (as DeepSpeed
    picks its FusedAdam), else torch's fused AdamW. Only the device decides, so the choice is
    checked here with the availability answer set both ways."""
    from deepspeed_cpp.runtime import config_optimizer

    monkeypatch.setattr(config_optimizer, "fused_adam_available", lambda: (available, "test"))
    factory = config_optimizer.config_optimizer_factory(
        "Adam", {"lr": 1e-2, "weight_decay": 0.1}, torch.device("cuda", 0)
    )
    model = _model()
    optimizer = factory([{"params": list(model.parameters())}])
    if available:
        assert type(optimizer) is FusedAdam and optimizer.adam_w_mode
    else:
        assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]
    # torch's AdamW in float64 on our gradients, step by step: a float64 model of its own would
    # compute other gradients, and an element whose gradient nearly cancels turns that into more
    # than the tolerance (DS_TEST_SEED=1613760483: 1.4e-5 after 5 steps, both choices).
    reference = [p.detach().double().clone() for p in model.parameters()]
    expected = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    for batch in _batches(5):
        optimizer.zero_grad()
        _backward(model, batch)
        for ref, param in zip(reference, model.parameters()):
            ref.grad = param.grad.double()
        optimizer.step()
        expected.step()
    for ours, ref in zip(model.parameters(), reference):
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cpu_parameters_step_like_torch(dtype):
    """bf16/fp16 parameters on the CPU (DeepSpeed's CPU FusedAdam takes them): float32 moments;
    each step is torch's float64 AdamW from the parameter's current value, rounded to ``dtype``
    (one rounding step apart at most: the kernel's arithmetic is float32)."""
    hp = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.05)
    param = torch.nn.Parameter(torch.randn(257).to(dtype))
    optimizer = FusedAdam([param], **hp)
    reference = torch.nn.Parameter(param.detach().double())
    reference_optimizer = torch.optim.AdamW([reference], foreach=False, **hp)
    for _ in range(4):
        grad = torch.randn(257).to(dtype)
        param.grad, reference.grad = grad, grad.double()
        with torch.no_grad():
            reference.copy_(param.double())  # the rounded value both step from
        optimizer.step()
        reference_optimizer.step()
        assert optimizer.state[param]["exp_avg"].dtype == torch.float32
        expected = reference.detach().to(dtype)
        ulp = storage_ulp(expected.float(), dtype)  # one step of ``dtype`` there
        assert ((param.detach().float() - expected.float()).abs() <= ulp * 1.01).all()
