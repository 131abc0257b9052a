"""cpu_lion and DeepSpeedCPULion against a float64 Lion reference, plus opcheck, low-precision
storage, the copy-out and bad input."""

import copy

import pytest
import torch

from deepspeed_cpp.ops import cpu_lion_step, cpu_lion_step_multi
from deepspeed_cpp.ops.cpu_lion import cpu_lion_isa, load_cpu_lion
from deepspeed_cpp.optim import DeepSpeedCPULion

SIZES = [1, 7, 17, 65, 4095, 2**18 + 3]
STEPS = 20


def _reference(param, grads, lr, beta1, beta2, weight_decay):
    """Float64 Lion (Chen et al. 2023, Algorithm 2), and per element how many of its steps had an
    interpolation so close to 0 that float32 rounding may give it the other sign."""
    p = param.double().clone()
    m = torch.zeros_like(p)
    ambiguous = torch.zeros_like(p)
    for g in grads:
        g = g.double()
        interpolated = beta1 * m + (1 - beta1) * g
        size = beta1 * m.abs() + (1 - beta1) * g.abs()
        # float32 state carries ~1e-6 relative error after tens of steps: signs of values
        # within 1e-5 of the terms' size are not decided by the math alone.
        ambiguous += (interpolated.abs() <= 1e-5 * size).double()
        p = p * (1 - lr * weight_decay) - lr * torch.sign(interpolated)
        m = beta2 * m + (1 - beta2) * g
    return p, ambiguous


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_float64_lion(size, weight_decay):
    lr, beta1, beta2 = 1e-3, 0.9, 0.99
    param = torch.randn(size)
    grads = [torch.randn(size) * torch.empty(1).uniform_(0.01, 2) for _ in range(STEPS)]
    ours, exp_avg = param.clone(), torch.zeros(size)
    for g in grads:
        cpu_lion_step(ours, g, exp_avg, lr=lr, beta1=beta1, beta2=beta2,
                      weight_decay=weight_decay)  # fmt: skip
    reference, ambiguous = _reference(param, grads, lr, beta1, beta2, weight_decay)
    # Every step moves each element by exactly lr (a sign), so the float32 result is the float64
    # one up to float32 rounding of the parameter, plus 2 lr for each step whose sign was a tie.
    bound = 4e-7 * (reference.abs() + 1) * STEPS + 2 * lr * ambiguous
    assert ((ours.double() - reference).abs() <= bound).all()


def test_sign_of_zero_and_nan():
    # A zero interpolation leaves the parameter alone (torch.sign(0) = 0); NaN propagates.
    param, exp_avg = torch.tensor([1.0, 2.0, 3.0] * 11), torch.zeros(33)
    grad = torch.tensor([0.0, float("nan"), -1.0] * 11)
    cpu_lion_step(param, grad, exp_avg, lr=0.5)
    assert torch.equal(param[0::3], torch.ones(11))
    assert param[1::3].isnan().all()
    assert torch.equal(param[2::3], torch.full((11,), 3.5))


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_step_is_the_float32_step_rounded(param_dtype, state_dtype):
    n = 2**12 + 5
    param, grad = torch.randn(n).to(param_dtype), torch.randn(n).to(torch.float16)
    exp_avg = torch.randn(n).to(state_dtype)
    p32, m32 = param.to(torch.float32, copy=True), exp_avg.to(torch.float32, copy=True)
    cpu_lion_step(p32, grad.float(), m32, lr=1e-2, weight_decay=0.1)
    copy_out = torch.empty(n, dtype=torch.bfloat16) if param_dtype == torch.float32 else None
    cpu_lion_step(param, grad, exp_avg, lr=1e-2, weight_decay=0.1, param_lowp=copy_out)
    assert torch.equal(param, p32.to(param_dtype)) and torch.equal(exp_avg, m32.to(state_dtype))
    if copy_out is not None:
        assert torch.equal(copy_out, p32.to(torch.bfloat16))


def test_found_inf_skips_the_step():
    params, grads, exp_avgs = [torch.randn(50000)], [torch.randn(50000)], [torch.randn(50000)]
    grads[0][-1] = float("inf")
    before = [params[0].clone(), exp_avgs[0].clone()]
    flag = torch.zeros(1)
    cpu_lion_step_multi(params, grads, exp_avgs, lr=1e-3, found_inf=flag)
    assert flag.item() == 1.0
    assert torch.equal(params[0], before[0]) and torch.equal(exp_avgs[0], before[1])


def test_opcheck():
    load_cpu_lion()
    sizes = [37, 5, 1]
    args = ([torch.randn(s) for s in sizes], [torch.randn(s) for s in sizes],
            [torch.randn(s) for s in sizes], 1e-3, 0.9, 0.99, 0.1)  # fmt: skip
    op = torch.ops.deepspeed_cpp.cpu_lion_step_multi.default
    torch.library.opcheck(op, args)
    torch.library.opcheck(op, args, dict(params_lowp=[torch.empty(s, dtype=torch.float16)
                                                      for s in sizes],
                                         grad_scale=2.0, found_inf=torch.zeros(1)))  # fmt: skip


def test_isa_level_reported():
    assert cpu_lion_isa() in ("scalar", "avx2", "avx512", "neon")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-1.0), "cpu_lion: lr must be >= 0, got -1"),
        (dict(beta1=1.5), "cpu_lion: beta1 must be in [0, 1], got 1.5"),
        (dict(beta2=-0.5), "cpu_lion: beta2 must be in [0, 1], got -0.5"),
        (dict(weight_decay=-0.5), "cpu_lion: weight_decay must be >= 0, got -0.5"),
        (
            dict(exp_avg=torch.zeros(8, 2)[:, 0]),
            "cpu_lion: exp_avg[0] must be contiguous, got strides [2]",
        ),
        (
            dict(exp_avg=torch.zeros(8, dtype=torch.float16)),
            "cpu_lion: exp_avg[0] must be float32 or bfloat16, got dtype Half",
        ),
    ],
)
def test_bad_input_names_argument_value_and_expectation(kwargs, message):
    args = dict(param=torch.randn(8), grad=torch.randn(8), exp_avg=torch.zeros(8), lr=1e-3)
    args.update(kwargs)
    with pytest.raises(RuntimeError) as error:
        cpu_lion_step(**args)
    assert message in str(error.value)


# --- the optimizer class --------------------------------------------------------------------


def _model():
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 5))


def test_optimizer_matches_the_op_and_float64_reference():
    model = _model()
    initial = [p.detach().clone() for p in model.parameters()]
    optimizer = DeepSpeedCPULion(model.parameters(), lr=1e-3, betas=(0.9, 0.99),
                                 weight_decay=0.1)  # fmt: skip
    grads_per_step = []
    for _ in range(10):
        x, y = torch.randn(8, 13), torch.randn(8, 5)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        grads_per_step.append([p.grad.clone() for p in model.parameters()])
        optimizer.step()
    for index, (p, p0) in enumerate(zip(model.parameters(), initial)):
        reference, ambiguous = _reference(p0, [g[index] for g in grads_per_step], 1e-3, 0.9, 0.99,
                                          0.1)  # fmt: skip
        bound = 4e-7 * (reference.abs() + 1) * 10 + 2e-3 * ambiguous
        assert ((p.detach().double() - reference).abs() <= bound).all()
    assert set(optimizer.state_dict()["state"][0]) == {"step", "exp_avg"}


def test_state_dict_round_trip_is_exact():
    model = _model()
    optimizer = DeepSpeedCPULion(model.parameters(), lr=1e-3)
    batches = [(torch.randn(8, 13), torch.randn(8, 5)) for _ in range(6)]

    def train(m, o, data):
        for x, y in data:
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()

    train(model, optimizer, batches[:3])
    resumed = copy.deepcopy(model)
    resumed_optimizer = DeepSpeedCPULion(resumed.parameters(), lr=1.0)
    resumed_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    train(model, optimizer, batches[3:])
    train(resumed, resumed_optimizer, batches[3:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"betas\[1\] must be in \[0, 1\], got 1.5"):
        DeepSpeedCPULion(_model().parameters(), betas=(0.9, 1.5))
