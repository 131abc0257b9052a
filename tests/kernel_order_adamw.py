"""AdamW for the one-process references that the ZeRO engine tests compare with at 1e-6.

torch.optim.AdamW and our kernels (csrc/common/adam_math.h, behind FusedAdam and cpu_adam) both
compute AdamW in float32, but round differently: after one step the masters already differ by
an ulp here and there (measured: 3.4e-8 of the largest weight, the per-rank gradients bitwise
equal). A parameter whose gradient nearly cancels turns such an ulp of its inputs into up to
lr / eps times as much (DS_TEST_SEED=1715069634: 2.02e-6 after 4 steps), so a float32 reference
has to round as the kernels do. This one is written from the formula the header documents
(its operations, in its order, fused multiply-adds rounded once), in torch, and every step is
checked against torch.optim.AdamW run in float64 on the same gradients, so the reference stays
AdamW and only its float32 rounding follows the kernels.

Every float32 operation is computed in float64 and rounded to float32 once: products are exact
in float64, and a float64 square root or quotient rounded to float32 is the correctly rounded
float32 one (53 >= 2 * 24 + 2 bits), as sqrtf and '/' are. torch's own float32 sqrt on the CPU is
not always correctly rounded (a vectorised approximation: one ulp off for some inputs).

``clip_as_the_engine`` clips the references' gradients with the engine's arithmetic, for the same
reason.
"""

from __future__ import annotations

import math

import torch

# A float32 step against float64 AdamW on the same gradients: a few ulps of the update (<= lr).
_FLOAT64_AGREEMENT = 1e-6


def fma32(a: torch.Tensor, b: torch.Tensor | float, c: torch.Tensor) -> torch.Tensor:
    """float32 a * b + c rounded once (C's fmaf): the product is exact in float64, the sum's
    rounding error is recovered exactly (TwoSum), and it decides the one case where rounding
    the float64 sum to float32 rounds twice: a float64 sum exactly halfway between floats."""
    p = a.double() * (b.double() if isinstance(b, torch.Tensor) else float(torch.tensor(b)))
    cd = c.double()
    s = p + cd
    bp = s - p
    error = (p - (s - bp)) + (cd - bp)
    rounded = s.float()
    toward = torch.where(s > rounded.double(), math.inf, -math.inf).float()
    neighbour = torch.nextafter(rounded, toward)
    halfway = (s - rounded.double()).abs() * 2 == (neighbour.double() - rounded.double()).abs()
    # Halfway: the exact sum lies on error's side of s; pick the float on that side.
    above = torch.where(rounded.double() > s, rounded, neighbour)
    below = torch.where(rounded.double() < s, rounded, neighbour)
    fixed = torch.where(error > 0, above, below)
    return torch.where(halfway & (error != 0), fixed, rounded)


def _mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """float32 a * b rounded once: exact in float64, then rounded."""
    return (a.double() * b.double()).float()


class KernelOrderAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction) over float32 parameters, rounding as
    adam_math.h: per-step constants folded in float64 and rounded to float32 once."""

    def __init__(self, params, lr, betas, eps, weight_decay):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(f"KernelOrderAdamW steps float32 parameters, got {p.dtype}")
        self._shadow = [p.detach().double().clone().requires_grad_(True) for p in self._params()]
        shadows = iter(self._shadow)
        self._float64 = torch.optim.AdamW(
            [
                {**{k: v for k, v in g.items() if k != "params"},
                 "params": [next(shadows) for _ in g["params"]]}
                for g in self.param_groups
            ],
            foreach=False,
        )  # fmt: skip

    def _params(self):
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                bc1, bc2 = 1.0 - beta1**t, 1.0 - beta2**t
                f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
                g = p.grad
                m = fma32(state["exp_avg"], f32(beta1), _mul(f32(1.0 - beta1), g))
                v = fma32(state["exp_avg_sq"], f32(beta2), _mul(_mul(f32(1.0 - beta2), g), g))
                root = v.double().sqrt().float()
                denom = fma32(root, f32(1.0 / math.sqrt(bc2)), torch.full_like(v, group["eps"]))
                update = (m.double() / denom.double()).float()
                decayed = _mul(p, f32(1.0 - lr * group["weight_decay"]))
                p.copy_(fma32(update, f32(-lr / bc1), decayed))
                state["exp_avg"], state["exp_avg_sq"] = m, v
        for shadow, p in zip(self._shadow, self._params()):
            shadow.grad = p.grad.double()
        for shadow_group, group in zip(self._float64.param_groups, self.param_groups):
            shadow_group["lr"] = group["lr"]  # a schedule may have changed it
        self._float64.step()
        scale = max(s.abs().max().item() for s in self._shadow)
        worst = max(
            (p.double() - s).abs().max().item() for p, s in zip(self._params(), self._shadow)
        )
        assert worst <= _FLOAT64_AGREEMENT * scale, f"not AdamW: {worst} of {scale} from float64"


def clip_as_the_engine(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (no clipping for ``max_norm`` 0) with the ZeRO engine's
    arithmetic, so that the references clip as it does: the norm summed in float64
    (``shard_norms.global_norm``: the shards' float32 norms squared and summed in float64) and the
    coefficient ``max_norm / (norm + 1e-6)`` a Python float, where torch's is a float32 tensor.
    The two coefficients differ in their last float32 bits, and that alone put a reference 1.22e-6
    from the engine after 3 steps (DS_TEST_SEED=650804520,
    test_engine_zero.py::test_a_config_without_gradient_clipping_clips_at_deepspeeds_default;
    4.8e-8 clipped this way). Returns the norm (float32, as torch's)."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    if max_norm:
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            torch._foreach_mul_(grads, coefficient)
    return torch.tensor(norm, dtype=torch.float32)
