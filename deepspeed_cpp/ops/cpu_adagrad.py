"""Python entry points of csrc/cpu_adagrad: one Adagrad step over CPU tensors, in place.

The step is torch.optim.Adagrad's: ``clr = lr / (1 + (step - 1) * lr_decay)``,
``g = grad + weight_decay * param``, ``state_sum += g * g``,
``param -= clr * g / (sqrt(state_sum) + eps)``, computed in float32. Storage dtypes and the
optional ``params_lowp`` / ``grad_scale`` / ``found_inf`` arguments are as for
:func:`deepspeed_cpp.ops.cpu_adam.cpu_adam_step_multi`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cpu_adam import check_cpu_devices, isa_of, named_list
from .op_builder import CPUAdagradBuilder
from .op_loader import OpLoader


def load_cpu_adagrad() -> None:
    """Loads the op library (pre-built or JIT). Called before first use, outside torch.compile."""
    _op.load()


def _fake_multi(params, grads, state_sums, *hyper_params, params_lowp=None, grad_scale=1.0,
                found_inf=None) -> None:  # fmt: skip
    check_cpu_devices(
        "cpu_adagrad",
        named_list("params", params) + named_list("grads", grads)
        + named_list("state_sums", state_sums) + named_list("params_lowp", params_lowp)
        + [("found_inf", found_inf)],
    )  # fmt: skip


_op = OpLoader(CPUAdagradBuilder(), {"cpu_adagrad_step_multi": _fake_multi})


def cpu_adagrad_step_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    state_sums: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    lr_decay: float = 0.0,
    params_lowp: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adagrad step over lists of tensors, in one parallel region.

    ``params`` and ``state_sums`` are updated in place; ``step`` is the step number after this
    update (1 on the first call). Bitwise identical for any thread count and ISA level.
    """
    # With every list empty and no found_inf the dispatcher sees no tensor and cannot pick a
    # kernel (NotImplementedError): an empty step is simply nothing to do.
    if found_inf is None and not any((params, grads, state_sums)):
        return
    if not _op.ready:
        _op.load()
    torch.ops.deepspeed_cpp.cpu_adagrad_step_multi.default(
        list(params), list(grads), list(state_sums), step, lr, eps, weight_decay, lr_decay,
        params_lowp=None if params_lowp is None else list(params_lowp), grad_scale=grad_scale,
        found_inf=found_inf,
    )  # fmt: skip


def cpu_adagrad_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state_sum: torch.Tensor,
    *,
    step: int,
    lr: float,
    eps: float = 1e-10,
    weight_decay: float = 0.0,
    lr_decay: float = 0.0,
    param_lowp: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """`cpu_adagrad_step_multi` on one tensor."""
    cpu_adagrad_step_multi(
        [param], [grad], [state_sum], step=step, lr=lr, eps=eps, weight_decay=weight_decay,
        lr_decay=lr_decay, params_lowp=None if param_lowp is None else [param_lowp],
        grad_scale=grad_scale, found_inf=found_inf,
    )  # fmt: skip


def cpu_adagrad_isa() -> str:
    """The instruction-set level the kernel runs at in this process: avx512, avx2, neon, scalar."""
    return isa_of(_op.builder)
