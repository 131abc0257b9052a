"""Python entry points of csrc/fused_adam: Adam/AdamW over lists of CUDA tensors."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .op_builder import FusedAdamBuilder, FusedAdamHostBuilder, OpNotAvailableError, RegistryBuilder
from .op_loader import OpLoader

_OP_NAME = "deepspeed_cpp::fused_adam"
_cuda = OpLoader(FusedAdamBuilder())


def fused_adam_available() -> tuple[bool, str]:
    """Whether the CUDA op can run here, else why not: its library must be loadable (pre-built,
    or nvcc to build it) and a CUDA device visible. A pre-built library still loads on a machine
    without a GPU (``load_fused_adam()``), but there is nothing for it to run on."""
    ok, why = _cuda.builder.is_compatible()
    if not ok:
        return False, why
    if not torch.cuda.is_available():
        return False, (
            "no CUDA device is visible (torch.cuda.is_available() is False); the fused_adam op "
            "runs on CUDA tensors only (CPU parameters: deepspeed_cpp.optim.FusedAdam uses "
            "cpu_adam for them)"
        )
    return True, ""


def load_fused_adam() -> None:
    """Loads the CUDA op library (pre-built, else compiled with nvcc on first use).

    Raises OpNotAvailableError saying what is missing (a CUDA build of torch, nvcc, ...).
    """
    _cuda.load()
    _fake.load()


def load_fused_adam_host_emulation() -> None:
    """Registers a CPU kernel for ``fused_adam`` that runs the CUDA kernel's code on the host.

    The CPU kernel checks the arguments, plans the launches and runs the kernel body of every
    block of every launch, thread by thread: the code the GPU runs, far slower. Meant for tests
    and for debugging without a GPU; for CPU training use ``cpu_adam``.
    """
    FusedAdamHostBuilder().load()
    _fake.load()


def _fake_fused_adam(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    *hyper_params,
    lr_tensor=None,
    state_steps=None,
    inv_grad_scale=None,
    found_inf=None,
) -> None:
    # The meta implementation: nothing is returned, so only the one-device rule is checked here.
    lists = {
        "params": params,
        "grads": grads,
        "exp_avgs": exp_avgs,
        "exp_avg_sqs": exp_avg_sqs,
        "state_steps": state_steps or [],
    }
    named = [(f"{label}[{i}]", t) for label, ts in lists.items() for i, t in enumerate(ts)]
    scalars = {"lr_tensor": lr_tensor, "inv_grad_scale": inv_grad_scale, "found_inf": found_inf}
    named += [(name, t) for name, t in scalars.items() if t is not None]
    if named:
        first_name, first = named[0]
        for name, tensor in named[1:]:
            if tensor.device != first.device:
                raise ValueError(
                    f"fused_adam: {name} is on {tensor.device} but {first_name} is on "
                    f"{first.device}; one call updates one device"
                )


# The schema library with the meta kernel: on its own it serves the host emulation and tracing
# on machines without a GPU.
_fake = OpLoader(RegistryBuilder(), {"fused_adam": _fake_fused_adam})


def fused_adam(
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
    lr_tensor: torch.Tensor | None = None,
    state_steps: Sequence[torch.Tensor] | None = None,
    inv_grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam (L2) or AdamW (decoupled weight decay) step over lists of CUDA tensors, in place.

    ``params``, ``exp_avgs`` and ``exp_avg_sqs`` are updated, ``grads`` read; tensor ``i`` of each
    list has the same number of elements, all are contiguous and on one device. Params are
    float32, bfloat16 or float16 (one dtype for the list), grads any of those, the two state
    lists float32 or the params' dtype. The math is ``cpu_adam``'s, in float32, element by element.

    ``step`` is the step number after this update (1 on the first call). The optional tensors
    are one-element float32 tensors on the same device, read by the kernel when it runs (so the
    call can be captured in a CUDA graph): ``lr_tensor`` replaces ``lr``, ``state_steps[i]``
    replaces ``step`` for tensor ``i``, gradients are multiplied by ``inv_grad_scale`` before the
    update, and a non-zero ``found_inf`` makes the whole call a no-op.
    """
    params = list(params)
    if not params:
        return
    if params[0].device.type == "cuda":
        if not _cuda.ready:
            load_fused_adam()
    elif not torch.compiler.is_compiling():  # checked by the eager call that preceded tracing
        _fake.load()
        key = params[0].device.type.upper()
        if key != "META" and not torch._C._dispatch_has_kernel_for_dispatch_key(_OP_NAME, key):
            raise OpNotAvailableError(
                f"fused_adam: params[0] is on {params[0].device}; the op runs on CUDA tensors "
                f"(for CPU tensors use deepspeed_cpp.ops.cpu_adam_step_multi, which "
                f"deepspeed_cpp.optim.FusedAdam calls for you)"
            )
    torch.ops.deepspeed_cpp.fused_adam.default(
        params,
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        step,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        bias_correction,
        adamw_mode,
        lr_tensor=lr_tensor,
        state_steps=None if state_steps is None else list(state_steps),
        inv_grad_scale=inv_grad_scale,
        found_inf=found_inf,
    )
