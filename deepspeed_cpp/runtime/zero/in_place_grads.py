"""Gradients accumulated straight into the flat gradient buffers, reduced there in place.

At ZeRO stage 0 every rank holds each bucket's whole flat fp32 gradient (the tensor the master,
the flat parameters, steps with). The reducer would copy every gradient into a bucket of its
own, reduce that, and add it, scaled, into the flat gradient: two full passes over the gradients
per step that do nothing useful (measured on the pipeline benchmark with one replica: 0.10-0.13 s
of its 0.7 s step). Here instead every parameter's ``.grad`` is a view of its bucket's flat
gradient, installed before each backward: autograd accumulates every micro-step's gradient into
it in place, so at the accumulation boundary the buffer already holds this rank's sum. With
several data-parallel replicas that buffer is then all-reduced in place and scaled (each bucket
launched, in plan order on every rank, as soon as all its parameters' gradients are final in the
boundary backward, so the reduction overlaps the rest of the backward); with one replica there
is nothing to reduce.

The values equal the reducer's bit for bit: the first micro-step adds to zeros instead of taking
autograd's tensor (``0 + g == g``), the all-reduce sums the same buffers in the same layout, and
the scale is applied once to the sum (the reducer's ``mul_out`` onto zeroed gradients).

A ``.grad`` that user code replaced or cleared between backwards is honoured: its values are
copied into the view (cleared: zeros), and the view is put back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...comm.collective_errors import named_collective


def grads_can_stay_in_place(shards, stepper, scale: float) -> bool:
    """Whether a stage over ``shards`` (a ``ShardSet``) stepped by ``stepper`` can skip the
    reducer: stage 0, nothing offloaded or stepped during backward, fp32 parameters that view
    their buckets' flat tensors, and with one replica gradients scaled by exactly 1 (several
    replicas: any scale, applied after the all-reduce)."""
    return (
        shards.stage == 0
        and (shards.world_size > 1 or scale == 1.0)
        and shards.home.kind == "none"
        and not stepper.steps_during_backward
        and all(
            bucket.flat is not None and bucket.flat.dtype == torch.float32
            for bucket in shards.buckets
        )
    )


class InPlaceGradients:
    """The views of the flat gradient buffers that serve as the parameters' ``.grad``, and their
    in-place reduction over ``group`` (when it has several ranks)."""

    def __init__(
        self,
        buckets,
        shard_grads: list[torch.Tensor],
        members: list[list[int]],
        group=None,
        world_size: int = 1,
        scale: float = 1.0,
    ):
        """``members[b]``: the indices (in the optimizer's parameter order, the one the gradient
        hooks report) of bucket ``b``'s parameters, in ``buckets[b].params`` order."""
        self.params: list[torch.nn.Parameter] = []
        self.views: list[torch.Tensor] = []
        self.flat_grads = list(shard_grads)
        self.group, self.world_size, self.scale = group, world_size, scale
        self._bucket_of: dict[int, int] = {}
        self._view_of: dict[int, torch.Tensor] = {}
        self._sizes = [len(m) for m in members]
        for b, (bucket, flat_grad) in enumerate(zip(buckets, shard_grads)):
            for index, param, offset in zip(members[b], bucket.params, bucket.offsets):
                view = flat_grad.narrow(0, offset, param.numel()).view(param.shape)
                self.params.append(param)
                self.views.append(view)
                self._bucket_of[index] = b
                self._view_of[index] = view
        self._reducing = False

    @property
    def reduces(self) -> bool:
        return self.world_size > 1

    def install(self) -> None:
        """Makes every view its parameter's ``.grad`` (the buffers were just zeroed)."""
        for param, view in zip(self.params, self.views):
            param.grad = view

    def adopt(self) -> None:
        """Puts back the view of every parameter whose ``.grad`` was replaced or cleared, with
        the replacement's values (zeros for a cleared one)."""
        for param, view in zip(self.params, self.views):
            _adopt_one(param, view)

    # --- the in-place reduction of a boundary backward -----------------------------------------
    def begin_reduction(self) -> None:
        """Called before the boundary backward: buckets are launched as their gradients finish."""
        self._reducing = self.reduces
        self._waiting = list(self._sizes)
        self._launched: list[dist.Work] = []
        self._seen: set[int] = set()

    def grad_ready(self, index: int, param: torch.nn.Parameter) -> None:
        """A gradient hook: parameter ``index``'s gradient is final for this backward."""
        if not self._reducing:
            return
        b = self._bucket_of.get(index)
        if b is None:
            return
        if b < len(self._launched):
            # The sum is on its way to the other ranks while autograd adds to it: the ranks
            # would step with different, partial gradients. Nothing to mend, so stop loudly.
            raise RuntimeError(
                f"the gradient of parameter {index} (shape {list(param.shape)}) was accumulated "
                f"again after gradient bucket {b}, which holds it, began its all-reduce: the "
                "parameter is used twice in one backward and its bucket's other gradients were "
                "final first (reentrant activation checkpointing runs such a second use late); "
                "use torch.utils.checkpoint(..., use_reentrant=False) or deepspeed_cpp's "
                "activation checkpointing"
            )
        _adopt_one(param, self._view_of[index])  # autograd replaced it (create_graph=True)
        if index in self._seen:
            # Used twice (a shared layer in two reentrant checkpoints): counted once, the
            # bucket waits for its other parameters, and a later firing is checked above.
            return
        self._seen.add(index)
        self._waiting[b] -= 1
        self._launch_ready()

    def _launch_ready(self, every: bool = False) -> None:
        # Plan order on every rank: the k-th collective is the same bucket everywhere.
        while len(self._launched) < len(self._sizes):
            b = len(self._launched)
            if not every and self._waiting[b] > 0:
                return
            with named_collective(f"all_reduce of gradient bucket {b} (in place)"):
                work = dist.all_reduce(self.flat_grads[b], group=self.group, async_op=True)
            self._launched.append(work)

    def finish_reduction(self) -> None:
        """After the boundary backward: launches the buckets still waiting (parameters this
        backward did not use), waits for all, and scales the sums."""
        if not self._reducing:
            return
        self.adopt()  # a .grad replaced during backward goes into the buffer before its send
        self._launch_ready(every=True)
        for b, work in enumerate(self._launched):
            with named_collective(f"all_reduce of gradient bucket {b} (in place)"):
                work.wait()
            if self.scale != 1.0:
                self.flat_grads[b].mul_(self.scale)
        self._launched = []
        self._reducing = False


def _adopt_one(param: torch.nn.Parameter, view: torch.Tensor) -> None:
    grad = param.grad
    if grad is not None and grad.data_ptr() == view.data_ptr():
        return
    with torch.no_grad():
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
    param.grad = view
