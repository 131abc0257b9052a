"""FusedAdam: Adam/AdamW through the multi-tensor CUDA op on GPUs, through cpu_adam on the CPU."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..ops.cpu_adam import cpu_adam_step_multi, load_cpu_adam
from ..ops.fused_adam import fused_adam, load_fused_adam
from ..ops.op_builder import OpNotAvailableError
from .cpu_adam import check_adam_hyper_params
from .optimizer_base import OptimizerBase
from .torch_adam_state import complete_adam_group, refuse_unsupported_adam_flags

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class FusedAdam(OptimizerBase):
    """Adam (``adam_w_mode=False``: L2 added to the gradient) or AdamW (decoupled weight decay).

    The constructor is DeepSpeed's FusedAdam's. Parameters on CUDA devices are updated by the
    fused multi-tensor op (``deepspeed_cpp.ops.fused_adam``): float32, bfloat16 or float16
    parameters, with optimizer state in the parameters' dtype (as DeepSpeed and torch keep it),
    a handful of kernel launches per step for any number of tensors. Parameters on the CPU
    (float32, bfloat16 or float16, as DeepSpeed's CPU FusedAdam takes) are updated by
    ``cpu_adam``, with float32 state for low-precision parameters (the kernel keeps state in
    float32 or bfloat16 only; float32 also keeps small updates from vanishing in rounded
    moments). Both compute every element with the same function.

    State uses torch's names (``step``, ``exp_avg``, ``exp_avg_sq``), so state dicts move between
    this optimizer and ``torch.optim.Adam``/``AdamW``. Each param group may set its own ``lr``,
    ``betas``, ``eps``, ``weight_decay``, ``bias_correction`` and ``adam_w_mode``.

    ``capturable=True`` (not in DeepSpeed's signature; CUDA parameters only) keeps the step
    counts on the device and lets ``lr`` be a device tensor, so that ``step()`` launches kernels
    only and can be captured in a CUDA graph. It also lets ``torch.amp.GradScaler`` hand over
    the unscaling and the inf check: the kernel multiplies gradients by the inverse scale and
    skips the update, without a host synchronisation, when an inf or NaN was found.
    """

    # Each tensor has its own state and step count and tensors without a gradient are skipped,
    # so stepping a subset of the tensors at a time equals one step over all: ZeRO steps (and
    # all-gathers) bucket by bucket, as it does with DeepSpeedCPUAdam.
    steps_tensors_independently = True

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        capturable: bool = False,
    ):
        if amsgrad:
            raise ValueError(
                "FusedAdam does not support the AMSGrad variant (amsgrad=True); use "
                "torch.optim.AdamW(amsgrad=True) for that"
            )
        check_adam_hyper_params(lr, betas, eps, weight_decay)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            adam_w_mode=adam_w_mode,
            capturable=capturable,
            amsgrad=False,
        )
        super().__init__(params, defaults)
        self.adam_w_mode = adam_w_mode
        self.set_grad_none = set_grad_none
        # torch.amp.GradScaler passes grad_scale / found_inf to step() through attributes when
        # this is set, instead of unscaling and synchronising itself.
        self._step_supports_amp_scaling = capturable
        uses_cuda = uses_cpu = False
        for group_index, group in enumerate(self.param_groups):
            check_adam_hyper_params(
                group["lr"], group["betas"], group["eps"], group["weight_decay"]
            )
            for param_index, param in enumerate(group["params"]):
                _check_param(param, group, group_index, param_index)
                uses_cuda |= param.device.type == "cuda"
                uses_cpu |= param.device.type == "cpu"
        # Fail at construction, not at the first step, when an op cannot be had here.
        if uses_cuda:
            try:
                load_fused_adam()
            except OpNotAvailableError as error:
                raise OpNotAvailableError(
                    f"FusedAdam has CUDA parameters but the fused_adam CUDA op is not available: "
                    f"{error}. Install a build made with DS_BUILD_FUSED_ADAM=1, or the CUDA "
                    f"toolkit (nvcc) so that it compiles on first use."
                ) from error
        if uses_cpu:
            load_cpu_adam()

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        """Drops gradients (``set_grad_none=True``, the default) or zeroes them in place."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Set by torch.amp.GradScaler around this call (capturable mode only, see __init__).
        grad_scale = getattr(self, "grad_scale", None)
        found_inf = getattr(self, "found_inf", None)
        for group_index, group in enumerate(self.param_groups):
            # One native call per (device, dtypes, step) batch: normally one per group and device.
            batches: dict[tuple, tuple[list, list, list, list, list]] = defaultdict(
                lambda: ([], [], [], [], [])
            )
            counted: list[dict] = []  # the states whose step counter this call advances
            for param_index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                _check_param(param, group, group_index, param_index)
                grad = param.grad
                if grad.is_sparse:
                    raise RuntimeError(
                        f"FusedAdam does not support sparse gradients (param {param_index} of "
                        f"group {group_index})"
                    )
                if grad.dtype not in _DTYPES:
                    raise TypeError(
                        f"FusedAdam: the gradient of param {param_index} of group {group_index} "
                        f"is {grad.dtype}; expected float32, bfloat16 or float16"
                    )
                state = self._state_for(param, group)
                if group["capturable"]:
                    step_key = None  # read on the device
                else:
                    # The counters advance below, all with one op (a ZeRO-3 model steps one
                    # tensor per parameter: one add each was a few ms per step).
                    step_key = int(state["step"].item()) + 1
                    counted.append(state)
                key = (param.device, param.dtype, grad.dtype, state["exp_avg"].dtype, step_key)
                params, grads, exp_avgs, exp_avg_sqs, steps = batches[key]
                params.append(param)
                grads.append(grad.contiguous())
                exp_avgs.append(state["exp_avg"])
                exp_avg_sqs.append(state["exp_avg_sq"])
                steps.append(state["step"])
            if counted:
                # New tensors, not in place: loaded state dicts share step tensors with their
                # source.
                advanced = torch._foreach_add([state["step"] for state in counted], 1)
                for state, step in zip(counted, advanced):
                    state["step"] = step
            for key, batch in batches.items():
                if key[0].type == "cuda":
                    self._step_cuda(group, key[0], key[4], batch, grad_scale, found_inf)
                else:
                    self._step_cpu(group, key[4], batch)
        return loss

    def _state_for(self, param: torch.Tensor, group: dict) -> dict:
        state = self.state[param]
        on_cpu = param.device.type == "cpu"
        if not state:
            on_device = group["capturable"]
            state["step"] = torch.zeros(
                (), dtype=torch.float32, device=param.device if on_device else "cpu"
            )
            dtype = torch.float32 if on_cpu else param.dtype
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = torch.zeros_like(
                    param, dtype=dtype, memory_format=torch.contiguous_format
                )
        elif on_cpu and state["exp_avg"].dtype == torch.float16:
            # torch's load_state_dict casts state to the parameter's dtype; cpu_adam keeps
            # state in float32 or bfloat16 only.
            for key in ("exp_avg", "exp_avg_sq"):
                state[key] = state[key].float()
        return state

    def _step_cuda(self, group, device, step, batch, grad_scale, found_inf) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = batch
        hyper = _hyper_parameters(group)
        lr = group["lr"]
        if not group["capturable"]:
            fused_adam(params, grads, exp_avgs, exp_avg_sqs, step=step, lr=float(lr), **hyper)
            return
        # Capturable: everything stays on the device (no .item(), no host copies).
        lr_tensor = None
        if torch.is_tensor(lr):
            lr_tensor = lr.to(device=device, dtype=torch.float32).reshape(1)
            lr = 0.0  # replaced on the device by lr_tensor
        inv_grad_scale = None
        if grad_scale is not None:
            # GradScaler's own unscale_ multiplies by this same float32 reciprocal.
            inv_grad_scale = grad_scale.double().reciprocal().float().to(device).reshape(1)
        if found_inf is not None:
            # GradScaler gives a plain 0 when it checked no gradient.
            found_inf = torch.as_tensor(found_inf, dtype=torch.float32, device=device).reshape(1)
        torch._foreach_add_(steps, 1)
        fused_adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=1,
            lr=float(lr),
            lr_tensor=lr_tensor,
            state_steps=[s.reshape(1) for s in steps],
            inv_grad_scale=inv_grad_scale,
            found_inf=found_inf,
            **hyper,
        )
        if found_inf is not None:
            # A skipped step does not count (as in torch's fused optimizers).
            torch._foreach_sub_(steps, [found_inf.reshape(())] * len(steps))

    def _step_cpu(self, group, step, batch) -> None:
        params, grads, exp_avgs, exp_avg_sqs, _ = batch
        cpu_adam_step_multi(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=step,
            lr=float(group["lr"]),
            **_hyper_parameters(group),
        )

    def load_state_dict(self, state_dict) -> None:
        """Loads our own state dicts and those of torch.optim.Adam / AdamW."""
        refuse_unsupported_adam_flags(state_dict, "FusedAdam")
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            complete_adam_group(group, "adam_w_mode", self.defaults["adam_w_mode"])
            group["capturable"] = self.defaults["capturable"]
            for param in group["params"]:
                state = self.state.get(param)
                if not state:
                    continue
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = state[key].contiguous()
                step = state["step"]
                if not torch.is_tensor(step):
                    step = torch.tensor(float(step))
                device = param.device if group["capturable"] else "cpu"
                state["step"] = step.to(device=device, dtype=torch.float32)


def _check_param(param: torch.Tensor, group: dict, group_index: int, param_index: int) -> None:
    device_type = param.device.type
    if (
        (device_type == "cuda" or (device_type == "cpu" and not group["capturable"]))
        and param.dtype in _DTYPES
        and param.is_contiguous()
    ):
        return  # the common case, checked without building the messages below
    where = f"param {param_index} of group {group_index}"
    if param.device.type not in ("cuda", "cpu"):
        raise ValueError(f"FusedAdam needs CUDA or CPU parameters; {where} is on {param.device}")
    if group["capturable"] and param.device.type != "cuda":
        raise ValueError(
            f"FusedAdam(capturable=True) needs CUDA parameters; {where} is on {param.device}"
        )
    if param.dtype not in _DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in _DTYPES)
        raise TypeError(
            f"FusedAdam needs {names} parameters on {param.device.type}; {where} is {param.dtype}"
        )
    if not param.is_contiguous():
        raise ValueError(
            f"FusedAdam needs contiguous parameters; {where} has shape {tuple(param.shape)} and "
            f"strides {param.stride()}"
        )


def _hyper_parameters(group: dict) -> dict:
    """A param group's Adam hyper-parameters (all but lr) as the fused and CPU ops name them."""
    beta1, beta2 = group["betas"]
    return dict(
        beta1=beta1,
        beta2=beta2,
        eps=group["eps"],
        weight_decay=group["weight_decay"],
        bias_correction=group["bias_correction"],
        adamw_mode=group["adam_w_mode"],
    )
