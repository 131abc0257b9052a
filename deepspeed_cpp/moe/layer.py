"""``deepspeed.moe.layer.MoE`` stand-in: Mixture of Experts is not implemented in deepspeed_cpp.

Scripts such as DeepSpeed's CIFAR-10 example reference the class (``--moe``); constructing it
fails at once with a message naming it, instead of training something that is not MoE.
"""

from __future__ import annotations

from torch import nn

MOE_NOT_SUPPORTED = (
    "Mixture of Experts (deepspeed.moe.layer.MoE) is not implemented by deepspeed_cpp; "
    "build the model without MoE layers (e.g. run the script without --moe)"
)


class MoE(nn.Module):
    """DeepSpeed's MoE layer; refused by deepspeed_cpp (constructing one raises)."""

    def __init__(self, hidden_size: int, expert: nn.Module, num_experts: int = 1, *args, **kwargs):
        raise NotImplementedError(
            f"{MOE_NOT_SUPPORTED} (asked for MoE(hidden_size={hidden_size}, "
            f"num_experts={num_experts}, ...))"
        )
