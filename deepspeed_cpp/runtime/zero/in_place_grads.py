"""Gradients accumulated straight into the flat gradient buffers where nothing needs reducing.

With one data-parallel replica at ZeRO stage 0 the "reduction" of a bucket is the identity: the
reducer would copy every gradient into its bucket and then add the bucket, times 1, into the
shard gradient the optimizer reads, two full passes over the gradients per step for nothing
(measured on the pipeline benchmark: 0.10-0.13 s of its 0.7 s step). Here instead every
parameter's ``.grad`` is a view of its bucket's flat fp32 gradient (the tensor the master, the
flat parameters, steps with), installed before each backward: autograd accumulates every
micro-step's gradient into it in place, and at the accumulation boundary the buffer already
holds the sum. The values equal the reduced path's bit for bit (the first micro-step adds to
zeros instead of taking autograd's tensor; ``0 + g == g``).

A ``.grad`` that user code replaced or cleared between backwards is honoured: its values are
copied into the view (cleared: zeros), and the view is put back.
"""

from __future__ import annotations

import torch


def grads_can_stay_in_place(stage_object, scale: float) -> bool:
    """Whether ``stage_object`` (a ``ZeroPartitionedOptimizer`` after its buckets, masters and
    offload are set up) can skip the reducer: stage 0, one replica, nothing offloaded or stepped
    during backward, fp32 parameters that view their buckets' flat tensors, gradients scaled by
    exactly 1."""
    return (
        stage_object.stage == 0
        and stage_object.world_size == 1
        and scale == 1.0
        and stage_object.home.kind == "none"
        and not stage_object.steps_during_backward
        and all(
            bucket.flat is not None and bucket.flat.dtype == torch.float32
            for bucket in stage_object.buckets
        )
    )


class InPlaceGradients:
    """The views of the flat gradient buffers that serve as the parameters' ``.grad``."""

    def __init__(self, buckets, shard_grads: list[torch.Tensor]):
        self.params: list[torch.nn.Parameter] = []
        self.views: list[torch.Tensor] = []
        for bucket, flat_grad in zip(buckets, shard_grads):
            for param, offset in zip(bucket.params, bucket.offsets):
                self.params.append(param)
                self.views.append(flat_grad.narrow(0, offset, param.numel()).view(param.shape))

    def install(self) -> None:
        """Makes every view its parameter's ``.grad`` (the buffers were just zeroed)."""
        for param, view in zip(self.params, self.views):
            param.grad = view

    def adopt(self) -> None:
        """Puts back the view of every parameter whose ``.grad`` was replaced or cleared, with
        the replacement's values (zeros for a cleared one)."""
        for param, view in zip(self.params, self.views):
            grad = param.grad
            if grad is not None and grad.data_ptr() == view.data_ptr():
                continue
            with torch.no_grad():
                if grad is None:
                    view.zero_()
                else:
                    view.copy_(grad)
            param.grad = view
