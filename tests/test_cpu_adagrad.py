"""cpu_adagrad and DeepSpeedCPUAdagrad against torch.optim.Adagrad in float64, plus opcheck,
low-precision storage, the copy-out and bad input."""

import copy
import itertools

import pytest
import torch

from deepspeed_cpp.ops import cpu_adagrad_step, cpu_adagrad_step_multi
from deepspeed_cpp.ops.cpu_adagrad import cpu_adagrad_isa, load_cpu_adagrad
from deepspeed_cpp.optim import DeepSpeedCPUAdagrad

SIZES = [1, 7, 17, 65, 4095, 2**18 + 3]
MODES = [
    dict(weight_decay=wd, lr_decay=decay, initial_accumulator_value=init)
    for wd, decay, init in itertools.product([0.0, 0.1], [0.0, 0.05], [0.0, 0.3])
]
STEPS = 30


def _reference(param, grads, dtype, lr, eps, **mode):
    p = param.detach().to(dtype).clone().requires_grad_(True)
    optimizer = torch.optim.Adagrad([p], lr=lr, eps=eps, foreach=False, **mode)
    for g in grads:
        p.grad = g.to(dtype)
        optimizer.step()
    return p.detach()


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(f"{k}={v}" for k, v in m.items()))
def test_matches_torch_adagrad_float64(size, mode):
    lr, eps = 5e-2, 1e-10
    param = torch.randn(size)
    grads = [torch.randn(size) * torch.empty(1).uniform_(0.01, 2) for _ in range(STEPS)]
    ours = param.clone()
    state_sum = torch.full((size,), mode["initial_accumulator_value"])
    for step, g in enumerate(grads, start=1):
        cpu_adagrad_step(ours, g, state_sum, step=step, lr=lr, eps=eps,
                         weight_decay=mode["weight_decay"], lr_decay=mode["lr_decay"])  # fmt: skip
    reference = _reference(param, grads, torch.float64, lr, eps, **mode)
    # torch's own float32 Adagrad measures what float32 rounding alone costs; ours may not be
    # worse than that.
    fp32_error = _reference(param, grads, torch.float32, lr, eps, **mode).double() - reference
    error = (ours.double() - reference).abs().max().item()
    # Rounding errors scale with the magnitudes the parameters pass through, not with where they
    # end: a parameter that starts near 1 and ends near 0 carries ulps of 1 (seed 706243677,
    # size 1, ended at 1.3e-4).
    scale = max(reference.abs().max().item(), param.abs().max().item())
    # + 4 float32 ulps of that scale: with a handful of elements torch's own error can be zero
    # by luck, which no other float32 implementation could be asked to match.
    assert error <= 1.5 * fp32_error.abs().max().item() + 4 * 2**-23 * scale
    # And within 1e-5 of the scale wherever float32 can be: an element whose decayed gradient
    # nearly cancels (grad ~ -weight_decay * param) keeps a few float32 bits, and with no initial
    # accumulator its first step is lr times the sign of what is left, so torch's own float32
    # Adagrad is off there by up to 2 lr too (DS_TEST_SEED=2931075563, 262147 elements: one
    # element 6.6e-4 off in both).
    conditioned = fp32_error.abs() <= 1e-6 * scale
    assert int(conditioned.sum()) >= size - max(1, size // 1000)  # the bound still sees most
    difference = torch.where(conditioned, (ours.double() - reference).abs(), 0.0)
    assert difference.max().item() <= 1e-5 * scale


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_step_is_the_float32_step_rounded(param_dtype, state_dtype):
    n = 2**12 + 5
    param, grad = torch.randn(n).to(param_dtype), torch.randn(n).to(torch.bfloat16)
    state = torch.rand(n).to(state_dtype)
    p32, s32 = param.to(torch.float32, copy=True), state.to(torch.float32, copy=True)
    cpu_adagrad_step(p32, grad.float(), s32, step=2, lr=1e-2, weight_decay=0.1)
    copy_out = torch.empty(n, dtype=torch.float16) if param_dtype == torch.float32 else None
    cpu_adagrad_step(param, grad, state, step=2, lr=1e-2, weight_decay=0.1, param_lowp=copy_out)
    assert torch.equal(param, p32.to(param_dtype)) and torch.equal(state, s32.to(state_dtype))
    if copy_out is not None:
        assert torch.equal(copy_out, p32.to(torch.float16))


def test_found_inf_skips_and_grad_scale_unscales():
    params, grads = [torch.randn(9), torch.randn(20000)], [torch.randn(9), torch.randn(20000)]
    sums = [torch.zeros(9), torch.zeros(20000)]
    grads[1][12345] = float("nan")
    before = [t.clone() for t in params + sums]
    flag = torch.zeros(1)
    cpu_adagrad_step_multi(params, grads, sums, step=1, lr=0.1, found_inf=flag, grad_scale=4.0)
    assert flag.item() == 1.0
    assert all(torch.equal(a, b) for a, b in zip(params + sums, before))
    grads[1][12345] = 0.0
    reference = [p.clone() for p in params]
    reference_sums = [s.clone() for s in sums]
    cpu_adagrad_step_multi(reference, [g * 0.25 for g in grads], reference_sums, step=1, lr=0.1)
    cpu_adagrad_step_multi(params, grads, sums, step=1, lr=0.1, found_inf=flag.zero_(),
                           grad_scale=4.0)  # fmt: skip
    assert flag.item() == 0.0
    assert all(torch.equal(a, b) for a, b in zip(params + sums, reference + reference_sums))


def test_opcheck():
    load_cpu_adagrad()
    sizes = [37, 5, 1]
    args = ([torch.randn(s) for s in sizes], [torch.randn(s) for s in sizes],
            [torch.rand(s) for s in sizes], 3, 1e-2, 1e-10, 0.1, 0.01)  # fmt: skip
    op = torch.ops.deepspeed_cpp.cpu_adagrad_step_multi.default
    torch.library.opcheck(op, args)
    torch.library.opcheck(op, args, dict(params_lowp=[torch.empty(s, dtype=torch.bfloat16)
                                                      for s in sizes],
                                         grad_scale=2.0, found_inf=torch.zeros(1)))  # fmt: skip


def test_isa_level_reported():
    assert cpu_adagrad_isa() in ("scalar", "avx2", "avx512", "neon")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(step=0), "cpu_adagrad: step must be >= 1 (the step number after this update), got 0"),
        (dict(lr=-1.0), "cpu_adagrad: lr must be >= 0, got -1"),
        (dict(eps=-1.0), "cpu_adagrad: eps must be >= 0, got -1"),
        (dict(weight_decay=-0.5), "cpu_adagrad: weight_decay must be >= 0, got -0.5"),
        (dict(lr_decay=-0.5), "cpu_adagrad: lr_decay must be >= 0, got -0.5"),
        (
            dict(state_sum=torch.zeros(4)),
            "cpu_adagrad: state_sum[0] has 4 elements (shape [4]) but",
        ),
        (
            dict(grad=torch.randn(8).double()),
            "cpu_adagrad: grad[0] must be float32, bfloat16 or float16, got dtype Double",
        ),
    ],
)
def test_bad_input_names_argument_value_and_expectation(kwargs, message):
    args = dict(param=torch.randn(8), grad=torch.randn(8), state_sum=torch.zeros(8), step=1,
                lr=1e-2)  # fmt: skip
    args.update(kwargs)
    with pytest.raises(RuntimeError) as error:
        cpu_adagrad_step(**args)
    assert message in str(error.value)


def test_lists_of_unequal_length():
    with pytest.raises(RuntimeError, match="equal lengths, got params=2, state_sums=1"):
        cpu_adagrad_step_multi([torch.randn(3)] * 2, [torch.randn(3)] * 2, [torch.zeros(3)],
                               step=1, lr=1e-2)  # fmt: skip


# --- the optimizer class --------------------------------------------------------------------


def _model():
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.Tanh(), torch.nn.Linear(31, 5))


def _batches(n):
    return [(torch.randn(8, 13), torch.randn(8, 5)) for _ in range(n)]


def _train(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def test_optimizer_trains_like_torch_adagrad_in_float64():
    ours = _model()
    reference = copy.deepcopy(ours).double()
    hp = dict(lr=5e-2, eps=1e-10, weight_decay=0.01)
    optimizer = DeepSpeedCPUAdagrad(ours.parameters(), lr_decay=0.01, **hp)
    torch_optimizer = torch.optim.Adagrad(reference.parameters(), lr_decay=0.01, foreach=False,
                                          **hp)  # fmt: skip
    for x, y in _batches(15):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ours(x), y).backward()
        for p, q in zip(ours.parameters(), reference.parameters()):
            q.grad = p.grad.double()
        optimizer.step()
        torch_optimizer.step()
    for p, q in zip(ours.parameters(), reference.parameters()):
        assert (p.double() - q).abs().max() <= 2e-6 * q.abs().max()


def test_state_dicts_interoperate_with_torch_adagrad():
    model, batches = _model(), _batches(10)
    torch_optimizer = torch.optim.Adagrad(model.parameters(), lr=3e-2, foreach=False)
    _train(model, torch_optimizer, batches[:5])
    continued = copy.deepcopy(model)
    ours = DeepSpeedCPUAdagrad(model.parameters())
    ours.load_state_dict(copy.deepcopy(torch_optimizer.state_dict()))
    assert ours.param_groups[0]["lr"] == 3e-2
    torch_continued = torch.optim.Adagrad(continued.parameters(), foreach=False)
    torch_continued.load_state_dict(copy.deepcopy(torch_optimizer.state_dict()))
    _train(model, ours, batches[5:])
    _train(continued, torch_continued, batches[5:])
    for p, q in zip(model.parameters(), continued.parameters()):
        assert (p - q).abs().max() <= 1e-5 * q.abs().max()
    back = torch.optim.Adagrad(model.parameters(), foreach=False)
    back.load_state_dict(ours.state_dict())
    assert set(ours.state_dict()["state"][0]) == {"step", "sum"}


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match="lr_decay must be >= 0, got -1"):
        DeepSpeedCPUAdagrad(_model().parameters(), lr_decay=-1.0)
    with pytest.raises(ValueError, match="does not implement amsgrad=True"):
        DeepSpeedCPUAdagrad(_model().parameters(), amsgrad=True)


def test_sparse_embedding_gradients_step_only_their_rows_like_torch_adagrad():
    """nn.Embedding(sparse=True) against torch's Adagrad in float64 (which steps sparse gradients
    row-wise too): rows a batch does not touch keep their value and their ``sum``."""
    vocab, dim = 40, 6
    ours = torch.nn.Embedding(vocab, dim, sparse=True)
    reference = copy.deepcopy(ours).double()
    hp = dict(lr=5e-2, eps=1e-10, lr_decay=0.02, initial_accumulator_value=0.1)
    optimizer = DeepSpeedCPUAdagrad(ours.parameters(), **hp)
    torch_optimizer = torch.optim.Adagrad(reference.parameters(), foreach=False, **hp)
    touched = torch.zeros(vocab, dtype=torch.bool)
    for _ in range(8):
        tokens = torch.randint(0, vocab // 2, (5, 3))  # the upper half is never touched
        touched[tokens.flatten()] = True
        weights = torch.randn(5, 3, dim)
        for model in (ours, reference):
            model.zero_grad()
            (model(tokens) * weights.to(model.weight.dtype)).sum().backward()
        before = ours.weight.detach().clone()
        optimizer.step()
        torch_optimizer.step()
        assert torch.equal(ours.weight[vocab // 2 :], before[vocab // 2 :])
    state = optimizer.state[ours.weight]
    assert int(state["step"]) == 8
    assert torch.all(state["sum"][~touched] == 0.1)
    expected = torch_optimizer.state[reference.weight]["sum"]
    assert (state["sum"].double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    q = reference.weight
    assert (ours.weight.double() - q).abs().max() <= 2e-6 * q.abs().max()
    # What has no sparse path still says so.
    from deepspeed_cpp.optim import DeepSpeedCPUAdam

    ours.zero_grad()
    ours(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="DeepSpeedCPUAdam does not support sparse gradients"):
        DeepSpeedCPUAdam(ours.parameters()).step()
