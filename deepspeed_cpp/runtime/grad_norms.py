"""DeepSpeed's gradient-norm helpers from ``deepspeed.runtime.utils``: ``clip_grad_norm_``,
``get_weight_norm``, ``get_global_norm``, ``CheckOverflow``, ``has_inf_or_nan``.

deepspeed_cpp has no tensor parallelism: an ``mpu`` other than None is refused by name. Expert
(MoE) parameters hold different values on different ranks, so, as DeepSpeed does, a norm taken
over a rank's parameters is averaged over the data-parallel group and an overflow check over
them is agreed (max) over the largest expert-parallel group.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..utils import groups


def _refuse_mpu(mpu, who: str) -> None:
    if mpu is not None:
        raise NotImplementedError(
            f"{who}: mpu={mpu!r}: deepspeed_cpp has no tensor/model parallelism; pass mpu=None"
        )


def _is_moe_param(param) -> bool:
    return getattr(param, "allreduce", True) is False


def has_inf_or_nan(x: torch.Tensor) -> bool:
    """Whether ``x`` holds an inf or a NaN."""
    return not bool(torch.isfinite(x).all())


def _is_invalid(norm) -> bool:
    norm = float(norm)
    return math.isinf(norm) or math.isnan(norm) or norm == -1


def get_global_norm(norm_list) -> float:
    """The 2-norm of norms (``sqrt(sum(n ** 2))``); inf when any is inf, NaN or -1 (DeepSpeed's
    mark of a non-finite norm)."""
    if any(_is_invalid(norm) for norm in norm_list):
        return float("inf")
    return math.sqrt(sum(float(norm) ** 2 for norm in norm_list))


def get_weight_norm(parameters, norm_type=2, mpu=None) -> float:
    """The ``norm_type``-norm of the tensors' values (``p.data``, not gradients) viewed as one
    vector; -1 when it is not finite."""
    _refuse_mpu(mpu, "get_weight_norm")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    norm_type = float(norm_type)
    if norm_type == math.inf:
        total = max(float(p.data.abs().max()) for p in parameters)
    else:
        total = sum(float(p.data.float().norm(norm_type)) ** norm_type for p in parameters)
        total = total ** (1.0 / norm_type)
    return -1 if math.isinf(total) or math.isnan(total) else total


def clip_grad_norm_(parameters, max_norm, norm_type=2, mpu=None) -> torch.Tensor:
    """Scales the gradients in place so that their ``norm_type``-norm is at most ``max_norm``
    (coefficient ``max_norm / (norm + 1e-6)``, capped at 1); returns the norm. The norm of this
    rank's gradients is averaged over the data-parallel group first, so every rank scales by
    the same coefficient even where expert gradients differ between ranks."""
    _refuse_mpu(mpu, "clip_grad_norm_")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    parameters = [p for p in parameters if p.grad is not None]
    if not parameters:
        return torch.zeros(())
    norm_type = float(norm_type)
    norms = [p.grad.detach().float().norm(norm_type) for p in parameters]
    if norm_type == math.inf:
        total = torch.stack(norms).max()
    else:
        total = torch.stack(norms).pow(norm_type).sum().pow(1.0 / norm_type)
    if dist.is_available() and dist.is_initialized():
        group = groups._get_data_parallel_group()
        total = total / dist.get_world_size(group=group)
        dist.all_reduce(total, group=group)
    total = total.to(parameters[0].grad.device)
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for p in parameters:
        p.grad.detach().mul_(coefficient.to(p.grad.dtype))
    return total


class CheckOverflow:
    """Whether any gradient of ``param_groups`` (a list of parameter lists) is inf/NaN; with
    expert parameters among them, agreed (max) over the largest expert-parallel group."""

    def __init__(self, param_groups=None, mpu=None, zero_reduce_scatter=False, deepspeed=None):
        _refuse_mpu(mpu, "CheckOverflow")
        self.mpu = None
        self.zero_reduce_scatter = zero_reduce_scatter
        self.deepspeed = deepspeed
        self.params = [p for group in param_groups for p in group] if param_groups else None
        self.has_moe_params = any(_is_moe_param(p) for p in self.params or [])

    def _agree(self, overflow: bool, has_moe_params: bool, reduce_all: bool) -> bool:
        flag = torch.tensor([1.0 if overflow else 0.0])
        if not (dist.is_available() and dist.is_initialized()):
            return overflow
        if has_moe_params:
            dist.all_reduce(
                flag, op=dist.ReduceOp.MAX, group=groups._get_max_expert_parallel_group()
            )
        if reduce_all:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag[0])

    def check_using_norm(self, norm_group, reduce_overflow=True) -> bool:
        """Overflow judged from already computed norms (inf, NaN or -1 is an overflow)."""
        overflow = any(_is_invalid(norm) for norm in norm_group)
        return self._agree(overflow, self.has_moe_params, reduce_overflow)

    def check(self, param_groups=None) -> bool:
        if param_groups is None:
            params, has_moe = self.params or [], self.has_moe_params
        else:
            params = [p for group in param_groups for p in group]
            has_moe = any(_is_moe_param(p) for p in params)
        return self.has_overflow(params, has_moe_params=has_moe)

    def has_overflow_serial(self, params) -> bool:
        return any(p.grad is not None and has_inf_or_nan(p.grad) for p in params)

    def has_overflow(self, params, has_moe_params=None) -> bool:
        if has_moe_params is None:
            has_moe_params = self.has_moe_params
        reduce_all = self.zero_reduce_scatter or (
            getattr(self.deepspeed, "enable_backward_allreduce", True) is False
        )
        return self._agree(self.has_overflow_serial(params), has_moe_params, reduce_all)
