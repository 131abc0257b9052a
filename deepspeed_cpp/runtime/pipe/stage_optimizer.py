"""The ZeRO 0/1 optimizer of one pipeline stage: the engine's partitioned optimizer, with the two
quantities that must cover the whole model rather than one stage summed over the stages of a
replica (the pipeline's ``model`` group): the gradient norm (for clipping) and the fp16 overflow
flag. A tied weight held by several stages is counted once, on its first stage."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective
from ..zero.partitioned_optimizer import ZeroPartitionedOptimizer


class PipelineStageOptimizer(ZeroPartitionedOptimizer):
    STAGES = (0, 1)  # DeepSpeed's pipelines take ZeRO 0 and 1 only

    def __init__(self, *args, model_group: dist.ProcessGroup, **kwargs):
        super().__init__(*args, **kwargs)
        self.model_group = model_group
        self._model_group_size = dist.get_world_size(model_group)
        self._replicated = [p for p in self.params if getattr(p, "ds_pipe_replicated", False)]

    def accumulated_grad(self, param: torch.nn.Parameter) -> torch.Tensor | None:
        """The gradient accumulated over this batch's micro-steps, before the data-parallel
        reduction: ``param.grad``, or its fp32 accumulator for a bf16/fp16 model."""
        if self._fp32_accumulators is not None:
            return self._fp32_accumulators[self._position_of[id(param)]]
        return param.grad

    def _sum_over_stages(self, value: torch.Tensor, what: str) -> torch.Tensor:
        if self._model_group_size > 1:
            with named_collective(what):
                dist.all_reduce(value, group=self.model_group)
        return value

    def _overflow_on_any_rank(self) -> bool:
        local = torch.zeros(1, dtype=torch.float32, device=self.shard_grads[0].device)
        for grad in self.shard_grads:
            local += (~torch.isfinite(grad)).any().float()
        local = self._sum_over_shards(local, "all_reduce of the overflow flag")
        return bool(self._sum_over_stages(local, "all_reduce of the overflow flag").item() > 0)

    def _global_norm(self) -> float:
        norms = self._shard_grad_norms()
        squares = torch.stack(norms).double().pow(2).sum().reshape(1)
        for param in self._replicated:
            fragment = self.fragment_of(param)
            if fragment.numel == 0:
                continue  # another replica owns this part of it (ZeRO-1)
            values = self.shard_grads[fragment.bucket].narrow(
                0, fragment.master_start, fragment.numel
            )
            squares -= values.double().pow(2).sum()
        squares = self._sum_over_shards(squares, "all_reduce of the gradient norm")
        total = self._sum_over_stages(squares, "all_reduce of the gradient norm over stages")
        return math.sqrt(max(float(total.item()), 0.0))
