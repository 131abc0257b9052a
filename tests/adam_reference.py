"""Independent float64 references for the Adam tests: torch's own optimizers, or the textbook
formula where torch has no switch (bias correction off)."""

import torch


def reference_adam_steps(param, grads, *, lr, betas, eps, weight_decay, adamw_mode,
                         bias_correction, dtype=torch.float64, return_path_max=False):  # fmt: skip
    """Runs len(grads) steps in `dtype` (float64 by default) and returns the final parameter.

    With return_path_max, also the largest |parameter| any step passed through (per element): the
    magnitude a float32 implementation rounds at, which start and end alone can understate.

    weight_decay is used at its float32 value, the one every float32 implementation receives: in
    L2 mode gradient + weight_decay * param nearly cancels for some elements, and there the
    ~1e-8 relative difference between e.g. 0.1 and float32(0.1) decides the result.
    """
    weight_decay = float(torch.tensor(weight_decay, dtype=torch.float32))
    p = param.detach().to(dtype).clone()
    path_max = p.abs()
    if bias_correction:
        cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
        p.requires_grad_(True)
        opt = cls([p], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        for g in grads:
            p.grad = g.to(dtype)
            opt.step()
            path_max = torch.maximum(path_max, p.detach().abs())
        return (p.detach(), path_max) if return_path_max else p.detach()
    beta1, beta2 = betas
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for g in grads:
        g = g.to(dtype)
        if adamw_mode:
            p.mul_(1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
        path_max = torch.maximum(path_max, p.abs())
    return (p, path_max) if return_path_max else p


def storage_ulp(magnitude: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One step of ``dtype`` at ``magnitude`` (eps * |x|, per element), floored at the smallest
    normal number: below it the steps stop shrinking (fp16's subnormals are 2**-24 apart)."""
    finfo = torch.finfo(dtype)
    return finfo.eps * magnitude.abs().clamp_min(finfo.tiny)
