"""Python entry points of csrc/cpu_adam: one Adam/AdamW step over fp32 CPU tensors."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from .op_builder import CPUAdamBuilder

_builder = CPUAdamBuilder()
_ready = False


def load_cpu_adam() -> None:
    """Loads the op library (pre-built or JIT). Called before first use, outside torch.compile."""
    global _ready
    if not _ready:
        _builder.load()
        torch.library.register_fake("deepspeed_cpp::cpu_adam_step")(_fake_single)
        torch.library.register_fake("deepspeed_cpp::cpu_adam_step_multi")(_fake_multi)
        _ready = True


def _check_devices(named_tensors) -> None:
    # The dispatcher routes a call with any non-CPU tensor away from the CPU kernel, so the
    # device check that names the argument lives here, in the fake (meta) implementation.
    for name, tensor in named_tensors:
        if tensor.device.type != "cpu":
            raise ValueError(f"cpu_adam: {name} must be a CPU tensor, got device {tensor.device}")


def _fake_single(param, grad, exp_avg, exp_avg_sq, *hyper_params) -> None:
    _check_devices(
        [("param", param), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)]
    )


def _fake_multi(params, grads, exp_avgs, exp_avg_sqs, *hyper_params) -> None:
    for label, tensors in (("params", params), ("grads", grads), ("exp_avgs", exp_avgs),
                           ("exp_avg_sqs", exp_avg_sqs)):  # fmt: skip
        _check_devices((f"{label}[{i}]", t) for i, t in enumerate(tensors))


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
) -> None:
    """One Adam (L2) or AdamW (decoupled weight decay) step, in place, on one tensor.

    ``param``, ``exp_avg`` and ``exp_avg_sq`` are updated in place; ``grad`` is read. All four
    must be contiguous float32 CPU tensors with the same number of elements. ``step`` is the step
    number after this update (1 on the first call), used for bias correction. The result does not
    depend on the number of threads.
    """
    if not _ready:
        load_cpu_adam()
    torch.ops.deepspeed_cpp.cpu_adam_step.default(
        param, grad, exp_avg, exp_avg_sq, step, lr, beta1, beta2, eps, weight_decay,
        bias_correction, adamw_mode,
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
) -> None:
    """`cpu_adam_step` over lists of tensors (same hyper-parameters), in one parallel region."""
    if not _ready:
        load_cpu_adam()
    torch.ops.deepspeed_cpp.cpu_adam_step_multi.default(
        list(params), list(grads), list(exp_avgs), list(exp_avg_sqs), step, lr, beta1, beta2,
        eps, weight_decay, bias_correction, adamw_mode,
    )  # fmt: skip


def cpu_adam_isa() -> str:
    """The instruction-set level the kernel runs at in this process: avx512, avx2 or scalar."""
    library = _builder.c_library()
    library.deepspeed_cpp_cpu_adam_isa.restype = ctypes.c_char_p
    return library.deepspeed_cpp_cpu_adam_isa().decode()
