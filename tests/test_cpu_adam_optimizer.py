"""DeepSpeedCPUAdam as a torch.optim.Optimizer: training against torch, groups, state dicts."""

import copy

import pytest
import torch

from deepspeed_cpp.ops import cpu_adam_step
from deepspeed_cpp.optim import DeepSpeedCPUAdam


def _model():
    return torch.nn.Sequential(torch.nn.Linear(13, 31), torch.nn.GELU(), torch.nn.Linear(31, 5))


def _train(model, optimizer, batches):
    for x, y in batches:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def _batches(n=20):
    return [(torch.randn(8, 13), torch.randn(8, 5)) for _ in range(n)]


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_training_matches_torch_optimizer_in_float64(adamw_mode):
    ours = _model()
    reference = copy.deepcopy(ours).double()
    torch_float32 = copy.deepcopy(ours)
    hp = dict(lr=1e-2, betas=(0.9, 0.98), eps=1e-7, weight_decay=0.05)
    optimizer = DeepSpeedCPUAdam(ours.parameters(), adamw_mode=adamw_mode, **hp)
    assert optimizer.adam_w_mode is adamw_mode  # DeepSpeed's attribute name
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    reference_optimizer = torch_cls(reference.parameters(), foreach=False, **hp)
    torch_float32_optimizer = torch_cls(torch_float32.parameters(), foreach=False, **hp)
    for x, y in _batches():
        # Same float32 gradients to all three, so only the update arithmetic differs.
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ours(x), y).backward()
        for p, q, r in zip(ours.parameters(), reference.parameters(), torch_float32.parameters()):
            q.grad, r.grad = p.grad.double(), p.grad.clone()
        optimizer.step()
        reference_optimizer.step()
        torch_float32_optimizer.step()
    # Within 2e-6 of the float64 result, or no further from it than torch's own float32 Adam:
    # with L2 weight decay (adamw_mode=False) a gradient that nearly cancels its decay term
    # (grad ~ -weight_decay * param) keeps only a few float32 bits, and with eps above it the
    # step moves by a good fraction of lr in float32 whoever computes it.
    for p, q, r in zip(ours.parameters(), reference.parameters(), torch_float32.parameters()):
        float32_error = (r.double() - q).abs().max()
        assert (p.double() - q).abs().max() <= max(2e-6 * q.abs().max(), 1.5 * float32_error)


def test_param_groups_with_their_own_hyper_parameters():
    model = _model()
    reference = copy.deepcopy(model).double()
    groups = [
        dict(params=list(model[0].parameters()), lr=2e-2, weight_decay=0.1),
        dict(params=list(model[2].parameters()), betas=(0.8, 0.9), adamw_mode=False),
    ]
    optimizer = DeepSpeedCPUAdam(groups, lr=1e-3, weight_decay=0.0)
    reference_optimizers = [
        torch.optim.AdamW(reference[0].parameters(), lr=2e-2, weight_decay=0.1, foreach=False),
        torch.optim.Adam(reference[2].parameters(), lr=1e-3, betas=(0.8, 0.9), foreach=False),
    ]
    for x, y in _batches(10):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            q.grad = p.grad.double()
        optimizer.step()
        for ref in reference_optimizers:
            ref.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.double() - q).abs().max() <= 2e-6 * q.abs().max()


def test_state_dict_round_trip_is_exact():
    model, batches = _model(), _batches(12)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=5e-3, weight_decay=0.01)
    _train(model, optimizer, batches[:6])
    saved_model, saved_state = (
        copy.deepcopy(model.state_dict()),
        copy.deepcopy(optimizer.state_dict()),
    )
    _train(model, optimizer, batches[6:])

    resumed = _model()
    resumed.load_state_dict(saved_model)
    resumed_optimizer = DeepSpeedCPUAdam(resumed.parameters(), lr=1.0)
    resumed_optimizer.load_state_dict(saved_state)
    assert resumed_optimizer.param_groups[0]["lr"] == 5e-3
    _train(resumed, resumed_optimizer, batches[6:])
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "torch_cls, adamw_mode", [(torch.optim.AdamW, True), (torch.optim.Adam, False)]
)
def test_state_dicts_interoperate_with_torch(torch_cls, adamw_mode):
    batches = _batches(10)
    # torch -> ours: continue a torch run with DeepSpeedCPUAdam.
    model = _model()
    torch_optimizer = torch_cls(model.parameters(), lr=1e-2, weight_decay=0.02, foreach=False)
    _train(model, torch_optimizer, batches[:5])
    ours = DeepSpeedCPUAdam(model.parameters())
    ours.load_state_dict(copy.deepcopy(torch_optimizer.state_dict()))
    assert ours.param_groups[0]["adamw_mode"] is adamw_mode
    assert ours.param_groups[0]["lr"] == 1e-2
    continued = copy.deepcopy(model)
    torch_continued = torch_cls(continued.parameters(), foreach=False)
    torch_continued.load_state_dict(copy.deepcopy(torch_optimizer.state_dict()))
    _train(model, ours, batches[5:])
    _train(continued, torch_continued, batches[5:])
    for p, q in zip(model.parameters(), continued.parameters()):
        assert (p - q).abs().max() <= 1e-5 * q.abs().max()

    # ours -> torch: same keys (step, exp_avg, exp_avg_sq), torch continues from our state.
    state = ours.state_dict()
    assert set(state["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    back = torch_cls(model.parameters(), foreach=False)
    back.load_state_dict(state)
    assert torch.equal(back.state_dict()["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert float(back.state_dict()["state"][0]["step"]) == 10.0


def test_amsgrad_is_refused_clearly():
    with pytest.raises(ValueError, match="does not implement amsgrad=True"):
        DeepSpeedCPUAdam(_model().parameters(), amsgrad=True)
    model = _model()
    torch_optimizer = torch.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="param group 0 has amsgrad=True"):
        DeepSpeedCPUAdam(model.parameters()).load_state_dict(torch_optimizer.state_dict())


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lr=-0.1), "lr must be >= 0, got -0.1"),
        (dict(betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\), got 1.0"),
        (dict(betas=(-0.1, 0.9)), r"betas\[0\] must be in \[0, 1\), got -0.1"),
        (dict(eps=-1.0), "eps must be >= 0"),
        (dict(weight_decay=-1.0), "weight_decay must be >= 0"),
    ],
)
def test_bad_hyper_parameters(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DeepSpeedCPUAdam(_model().parameters(), **kwargs)


def test_bad_params_are_named():
    with pytest.raises(TypeError, match="param 0 of group 0 is torch.float64"):
        DeepSpeedCPUAdam([torch.zeros(3, dtype=torch.float64, requires_grad=True)])
    transposed = torch.nn.Parameter(torch.randn(4, 3).t())
    with pytest.raises(ValueError, match=r"param 0 of group 0 has shape \(3, 4\)"):
        DeepSpeedCPUAdam([transposed])


@pytest.mark.parametrize("fp32_optimizer_states", [True, False])
def test_bfloat16_params_step_like_the_op_with_the_asked_state_dtype(fp32_optimizer_states):
    model = _model().to(torch.bfloat16)
    twin = copy.deepcopy(model)
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01,
                                 fp32_optimizer_states=fp32_optimizer_states)  # fmt: skip
    state_dtype = torch.float32 if fp32_optimizer_states else torch.bfloat16
    states = {p: (torch.zeros(p.shape, dtype=state_dtype), torch.zeros(p.shape, dtype=state_dtype))
              for p in twin.parameters()}  # fmt: skip
    for step, (x, y) in enumerate(_batches(4), start=1):
        for m in (model, twin):
            m.zero_grad()
            torch.nn.functional.mse_loss(m(x.bfloat16()).float(), y).backward()
        optimizer.step()
        for p in twin.parameters():
            cpu_adam_step(p.data, p.grad, *states[p], step=step, lr=1e-2, weight_decay=0.01)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
        assert optimizer.state[p]["exp_avg"].dtype == state_dtype


def test_fp16_param_groups_receive_the_rounded_params():
    model = _model()
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    # A contiguous CPU copy is written by the kernel; a strided one through a buffer.
    copies = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
    copies[0] = torch.empty(tuple(reversed(params[0].shape)), dtype=torch.float16).t()
    for x, y in _batches(3):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step(fp16_param_groups=[copies])
        for p, c in zip(params, copies):
            assert torch.equal(c, p.detach().to(c.dtype))


def test_fp16_params_need_fp32_state():
    with pytest.raises(ValueError, match="use fp32_optimizer_states=True"):
        DeepSpeedCPUAdam(_model().half().parameters(), fp32_optimizer_states=False)
