"""The ZeRO-3 references' AdamW (tests/kernel_order_adamw.py) rounds as the kernels do: bitwise
equal to the cpu_adam op, and within rounding of torch.optim.AdamW in float64 (checked inside
each of its steps)."""

import torch
from kernel_order_adamw import KernelOrderAdamW, fma32

from deepspeed_cpp.ops import cpu_adam_step


def test_fma32_rounds_once():
    # (1 + 2^-23)^2 = 1 + 2^-22 + 2^-46: float32 a * b drops the 2^-46, so a * b + c is 0 where
    # the fused one, rounding only the sum, keeps it.
    a = torch.tensor([1.0 + 2.0**-23], dtype=torch.float32)
    c = torch.tensor([-(1.0 + 2.0**-22)], dtype=torch.float32)
    assert fma32(a, a, c).item() == 2.0**-46
    assert (a * a + c).item() == 0.0


def test_steps_equal_the_cpu_adam_kernel_bitwise():
    n = 4096
    lr, betas, eps, weight_decay = 1e-2, (0.9, 0.99), 1e-5, 0.05
    start = torch.randn(n) * 2
    ours = start.clone().requires_grad_(True)
    optimizer = KernelOrderAdamW([ours], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    kernel, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
    for step in range(1, 4):
        # Magnitudes from 1e-9 to 10: around eps, where Adam's rounding matters most.
        grad = torch.randn(n) * torch.logspace(-9, 1, n)[torch.randperm(n)]
        ours.grad = grad.clone()
        optimizer.step()
        cpu_adam_step(kernel, grad, m, v, step=step, lr=lr, beta1=betas[0], beta2=betas[1],
                      eps=eps, weight_decay=weight_decay, adamw_mode=True)  # fmt: skip
        assert torch.equal(ours.detach(), kernel), step
        assert torch.equal(optimizer.state[ours]["exp_avg"], m)
        assert torch.equal(optimizer.state[ours]["exp_avg_sq"], v)
