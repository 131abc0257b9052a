"""DeepSpeed's ``deepspeed.runtime.zero.linear``: a linear layer whose autograd function keeps
only the input and the weight for backward (``LinearFunctionForZeroStage3``), the
``zero3_linear_wrap`` entry point and ``LinearModuleForZeroStage3``.

DeepSpeed's ZeRO-3 swapped ``F.linear`` for this function so that its hooks see the weight used in
backward; deepspeed_cpp's ZeRO-3 needs no such swap (its hooks gather per module), so these are
plain, exact linear layers under DeepSpeed's names: y = x W^T + b, with the gradients of
``F.linear``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LinearFunctionForZeroStage3(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias=None):
        ctx.save_for_backward(input, weight, bias)
        return F.linear(input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input, weight, bias = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight.to(grad_output.dtype))
        if ctx.needs_input_grad[1]:
            grad_weight = (
                grad_output.reshape(-1, grad_output.shape[-1])
                .t()
                .matmul(input.reshape(-1, input.shape[-1]).to(grad_output.dtype))
            )
        if bias is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, grad_weight, grad_bias


def zero3_linear_wrap(input, weight, bias=None):
    """``F.linear(input, weight, bias)`` through ``LinearFunctionForZeroStage3``."""
    if bias is None:
        return LinearFunctionForZeroStage3.apply(input, weight)
    return LinearFunctionForZeroStage3.apply(input, weight, bias)


class LinearModuleForZeroStage3(nn.Linear):
    """``nn.Linear`` whose forward runs ``LinearFunctionForZeroStage3``."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return LinearFunctionForZeroStage3.apply(input, self.weight, self.bias)
