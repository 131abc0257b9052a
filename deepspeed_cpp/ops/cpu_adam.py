"""Python entry points of csrc/cpu_adam: one Adam/AdamW step over CPU tensors, in place.

Storage: params float32, bfloat16 or float16; grads float32, bfloat16 or float16; state float32
or bfloat16. One dtype per argument (shared by every tensor of a list). The arithmetic is float32
and rounds to low precision exactly like ``tensor.to(dtype)``. The helpers here are shared with
``cpu_adagrad`` and ``cpu_lion``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from .op_builder import CPUAdamBuilder
from .op_loader import OpLoader


def load_cpu_adam() -> None:
    """Loads the op library (pre-built or JIT). Called before first use, outside torch.compile."""
    _op.load()


def check_cpu_devices(op: str, named_tensors) -> None:
    """Raises ValueError naming the first tensor that is not on the CPU.

    The dispatcher routes a call with any non-CPU tensor away from the CPU kernel, so the device
    check that names the argument lives in the fake (meta) implementations, which call this.
    """
    for name, tensor in named_tensors:
        if tensor is not None and tensor.device.type != "cpu":
            raise ValueError(f"{op}: {name} must be a CPU tensor, got device {tensor.device}")


def named_list(label: str, tensors) -> list:
    """[(label[i], tensor), ...] for check_cpu_devices; an absent optional list gives []."""
    return [(f"{label}[{i}]", t) for i, t in enumerate(tensors or [])]


def isa_of(builder) -> str:
    """The ISA level a loaded CPU optimizer library runs at; raises for an invalid DS_CPU_ISA."""
    library = builder.c_library()
    query = getattr(library, f"deepspeed_cpp_{builder.NAME}_isa")
    query.restype = ctypes.c_char_p
    level = query().decode()
    if level.startswith("error: "):
        raise RuntimeError(level[len("error: ") :])
    return level


def _fake_single(param, grad, exp_avg, exp_avg_sq, *hyper_params, param_lowp=None,
                 grad_scale=1.0, found_inf=None) -> None:  # fmt: skip
    check_cpu_devices("cpu_adam", [("param", param), ("grad", grad), ("exp_avg", exp_avg),
                                   ("exp_avg_sq", exp_avg_sq), ("param_lowp", param_lowp),
                                   ("found_inf", found_inf)])  # fmt: skip


def _fake_multi(params, grads, exp_avgs, exp_avg_sqs, *hyper_params, params_lowp=None,
                grad_scale=1.0, found_inf=None) -> None:  # fmt: skip
    check_cpu_devices(
        "cpu_adam",
        named_list("params", params) + named_list("grads", grads)
        + named_list("exp_avgs", exp_avgs) + named_list("exp_avg_sqs", exp_avg_sqs)
        + named_list("params_lowp", params_lowp) + [("found_inf", found_inf)],
    )  # fmt: skip


_op = OpLoader(
    CPUAdamBuilder(), {"cpu_adam_step": _fake_single, "cpu_adam_step_multi": _fake_multi}
)


def cpu_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    param_lowp: torch.Tensor | None = None,
    grad_scale: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam (L2) or AdamW (decoupled weight decay) step, in place, on one tensor.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are updated in place; ``grad`` is read. All must be
    contiguous CPU tensors with the same number of elements (dtypes: see the module docstring).
    ``step`` is the step number after this update (1 on the first call), used for bias correction.

    ``param_lowp`` (bfloat16 or float16, float32 ``param`` only) receives the updated parameter
    rounded to its dtype in the same pass. The gradient is divided by ``grad_scale`` (the loss
    scale) first. ``found_inf`` (one float32 element): when non-zero on entry nothing happens;
    otherwise the unscaled gradient is checked first, and on any infinity or NaN it is set to 1
    and nothing is written, else to 0. The result does not depend on the number of threads nor on
    the ISA level.
    """
    if not _op.ready:
        _op.load()
    torch.ops.deepspeed_cpp.cpu_adam_step.default(
        param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
        bias_correction, adamw_mode, param_lowp=param_lowp, grad_scale=grad_scale,
        found_inf=found_inf,
    )  # fmt: skip


def cpu_adam_step_multi(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    params_lowp: Sequence[torch.Tensor] | None = None,
    grad_scale: float = 1.0,
    found_inf: torch.Tensor | None = None,
) -> None:
    """`cpu_adam_step` over lists of tensors (same hyper-parameters), in one parallel region.

    ``found_inf`` covers the whole list: one non-finite gradient anywhere skips every tensor.
    """
    # With every list empty and no found_inf the dispatcher sees no tensor and cannot pick a
    # kernel (NotImplementedError): an empty step is simply nothing to do.
    if found_inf is None and not any((params, grads, exp_avgs, exp_avg_sqs)):
        return
    if not _op.ready:
        _op.load()
    torch.ops.deepspeed_cpp.cpu_adam_step_multi.default(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), step, lr, beta1, beta2,
        eps, weight_decay, bias_correction, adamw_mode,
        params_lowp=None if params_lowp is None else list(params_lowp), grad_scale=grad_scale,
        found_inf=found_inf,
    )  # fmt: skip


def cpu_adam_isa() -> str:
    """The instruction-set level the kernel runs at in this process: avx512, avx2, neon, scalar."""
    return isa_of(_op.builder)
