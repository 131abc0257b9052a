"""DeepSpeed's ``deepspeed.moe.layer.MoE``: a Mixture-of-Experts layer with top-1/top-2 gating,
capacity and token dropping, and expert parallelism over ``ep_size`` ranks.

``MoE(...)(hidden_states)`` returns ``(output, l_aux, exp_counts)`` as DeepSpeed's does. Module
and parameter names follow DeepSpeed (``deepspeed_moe.gate.wg``,
``deepspeed_moe.experts.deepspeed_experts.<i>``) so that state dicts carry over.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..utils import groups
from ..utils.logging import logger
from .dispatch import Slots, all_to_all
from .experts import Experts
from .gating import TopKGate, check_noisy_gate_policy


class MOELayer(nn.Module):
    """Gate -> dispatch -> all-to-all -> local experts -> all-to-all -> combine."""

    def __init__(
        self,
        gate: TopKGate,
        experts: Experts,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
    ):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.l_aux = None
        self.exp_counts = None

    def _set_ep_group(self, ep_group) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def forward(self, *input: torch.Tensor, **kwargs) -> torch.Tensor:
        hidden = input[0]
        d_model = hidden.shape[-1]
        tokens = hidden.reshape(-1, d_model)
        used_token = input[1] if len(input) > 1 else None
        gate = self.gate.route_input(tokens, used_token)
        self.l_aux, self.exp_counts = gate.l_aux, gate.exp_counts
        num_experts = self.ep_size * self.num_local_experts
        slots = Slots(gate.routing, num_experts, gate.capacity)
        dispatched = slots.dispatch(tokens)  # [E * C, M], experts in global order
        # Rank r of the expert-parallel group receives every rank's chunk for its experts.
        dispatched = all_to_all(self.ep_group, dispatched)
        # (explicit capacity: -1 cannot be inferred when the capacity is 0)
        dispatched = dispatched.reshape(
            self.ep_size, self.num_local_experts, gate.capacity, d_model
        )
        expert_output = self.experts(dispatched)
        expert_output = all_to_all(self.ep_group, expert_output)
        expert_output = expert_output.reshape(num_experts * gate.capacity, d_model)
        combined = slots.combine(expert_output, tokens.shape[0])
        return combined.reshape(hidden.shape)


def _world_size() -> int | None:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


class MoE(nn.Module):
    """A Mixture-of-Experts layer (DeepSpeed's signature and forward contract).

    Args:
        hidden_size: the model dimension (last dimension of the input).
        expert: the expert module (``[..., hidden_size] -> [..., hidden_size]``), deep-copied
            ``num_experts // ep_size`` times on each rank.
        num_experts: experts in the layer, over all ranks.
        ep_size: ranks the experts are split over (must divide ``num_experts`` and the world).
        k: 1 or 2 (top-1 or top-2 gating).
        capacity_factor / eval_capacity_factor: tokens per expert, as a multiple of
            tokens / experts, in training / evaluation; at least ``min_capacity``.
        use_residual: Residual MoE: the output mixes the MoE output with ``expert`` applied to
            every token, by a learnt softmax coefficient.
        noisy_gate_policy: None, 'Jitter' (multiplicative input noise) or 'RSample' (Gumbel noise
            on the choice); top-1 only, and in training only.
        drop_tokens: drop tokens over capacity; False sizes the buffer for the busiest expert.
        use_rts: top-1 random token selection: tokens claim capacity in random order.
        enable_expert_tensor_parallelism: accepted; deepspeed_cpp has no tensor parallelism.
        top2_2nd_expert_sampling: top-2 chooses its second expert with Gumbel noise.

    The expert-parallel groups are created (collectively) at construction when torch.distributed
    is initialised, else by ``set_deepspeed_parallelism()`` later.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ):
        super().__init__()
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"MoE: num_experts={num_experts!r} must be a positive integer")
        if not isinstance(ep_size, int) or ep_size < 1 or num_experts % ep_size != 0:
            divisors = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
            raise ValueError(
                f"MoE: num_experts={num_experts} is not divisible by ep_size={ep_size!r}; each "
                f"expert-parallel rank holds num_experts // ep_size experts, so ep_size must be "
                f"one of {', '.join(map(str, divisors))}"
            )
        world_size = _world_size()
        if world_size is not None:
            groups.check_expert_parallel_size(ep_size, world_size, who="MoE: ep_size")
        elif ep_size > 1:
            raise ValueError(
                f"MoE: ep_size={ep_size} needs torch.distributed initialised with a world size "
                "divisible by ep_size (call deepspeed_cpp.init_distributed() before building the "
                "model); without it the only allowed value is 1"
            )
        if k not in (1, 2):
            raise ValueError(f"MoE: k={k!r} is not supported; allowed values: 1, 2")
        check_noisy_gate_policy(noisy_gate_policy, k)
        if use_tutel:
            logger.warning("deepspeed_cpp MoE: use_tutel=True is ignored (Tutel is not used)")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = groups.expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        self.k = k
        logger.info(
            "deepspeed_cpp MoE: num_experts=%d, ep_size=%d, num_local_experts=%d, k=%d",
            num_experts,
            ep_size,
            self.num_local_experts,
            k,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts
        )
        if use_residual:
            self.mlp = expert
            # The learnt weights of the MoE output and the dense expert's, softmax-normalised.
            self.coefficient = nn.Linear(hidden_size, 2)
        if world_size is not None:
            self.set_deepspeed_parallelism()

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Creates this layer's expert groups if needed (collective) and hands them to it."""
        self._create_process_groups(use_data_before_expert_parallel_)

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        if self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_
            )
        self.deepspeed_moe._set_ep_group(groups._get_expert_parallel_group(self.expert_group_name))

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """``(output, l_aux, exp_counts)``: output has ``hidden_states``' shape; l_aux is the
        load-balancing loss (add it, scaled, to the training loss); exp_counts the tokens that
        chose each expert, before capacity (int64 on the CPU)."""
        if self.ep_size > 1 and self.deepspeed_moe.ep_group is None:
            raise RuntimeError(
                f"MoE with ep_size={self.ep_size}: the expert-parallel group is not set; call "
                "set_deepspeed_parallelism() on every rank (after init_distributed())"
            )
        if used_token is None:
            output = self.deepspeed_moe(hidden_states)
        else:
            output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            output_mlp = self.mlp(hidden_states)
            if isinstance(output_mlp, tuple):
                output_mlp = output_mlp[0]  # a returned bias is ignored, as DeepSpeed does
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + output_mlp * coef[..., 1:]
        return output, self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
