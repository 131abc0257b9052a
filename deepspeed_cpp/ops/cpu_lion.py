"""Python entry points of csrc/cpu_lion: one Lion step over CPU tensors, in place.

Lion (Chen et al., 2023): ``update = sign(beta1 * exp_avg + (1 - beta1) * grad)``,
``param = param * (1 - lr * weight_decay) - lr * update``,
``exp_avg = beta2 * exp_avg + (1 - beta2) * grad``, computed in float32. Storage dtypes and the
optional ``params_lowp`` / ``grad_scale`` / ``found_inf`` arguments are as for
:func:`deepspeed_cpp.ops.cpu_adam.cpu_adam_step_multi`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cpu_adam import check_cpu_devices, isa_of, named_list
from .op_builder import CPULionBuilder
from .op_loader import OpLoader


def load_cpu_lion() -> None:
    """Loads the op library (pre-built or JIT). Called before first use, outside torch.compile."""
    _op.load()


def _fake_multi(params, grads, exp_avgs, *hyper_params, params_lowp=None, grad_scale=1.0,
                found_inf=None) -> None:  # fmt: skip
    check_cpu_devices(
        "cpu_lion",
        named_list("params", params) + named_list("grads", grads)
        + named_list("exp_avgs", exp_avgs) + named_list("params_lowp", params_lowp)
        + [("found_inf", found_inf)],
    )  # fmt: skip


_op = OpLoader(CPULionBuilder(), {"cpu_lion_step_multi": _fake_multi})


def cpu_lion_step_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    params_lowp: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Lion step over lists of tensors, in one parallel region.

    ``params`` and ``exp_avgs`` are updated in place. Bitwise identical for any thread count and
    ISA level.
    """
    # With every list empty and no found_inf the dispatcher sees no tensor and cannot pick a
    # kernel (NotImplementedError): an empty step is simply nothing to do.
    if found_inf is None and not any((params, grads, exp_avgs)):
        return
    if not _op.ready:
        _op.load()
    torch.ops.deepspeed_cpp.cpu_lion_step_multi.default(
        list(params), list(grads), list(exp_avgs), lr, beta1, beta2, weight_decay,
        params_lowp=None if params_lowp is None else list(params_lowp), grad_scale=grad_scale,
        found_inf=found_inf,
    )  # fmt: skip


def cpu_lion_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.0,
    param_lowp: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """`cpu_lion_step_multi` on one tensor."""
    cpu_lion_step_multi(
        [param], [grad], [exp_avg], lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
        params_lowp=None if param_lowp is None else [param_lowp], grad_scale=grad_scale,
        found_inf=found_inf,
    )  # fmt: skip


def cpu_lion_isa() -> str:
    """The instruction-set level the kernel runs at in this process: avx512, avx2, neon, scalar."""
    return isa_of(_op.builder)
