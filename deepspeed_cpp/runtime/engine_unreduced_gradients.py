"""The engine's gradients that its own backward did not reduce: those of ``engine.no_sync()``
blocks (each rank's own, reduced by the next boundary backward or before the step) and those a
script wrote into ``.grad`` itself before ``engine.step()`` (DeepSpeed steps with them)."""

from __future__ import annotations

import contextlib

import torch

from .no_sync import refuse_entering as refuse_no_sync
from .zero.param_fragments import fragment_owner


class EngineUnreducedGradients:
    """Mixed into ``DeepSpeedEngine``: reads its ``optimizer``, ``module``, ``_call_order`` and
    the no_sync flags it sets up (``_inside_no_sync``, ``_reduction_owed``)."""

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's context manager: the backward passes inside it do not reduce gradients,
        which accumulate on each rank until a backward after it reduces them all (stages 0/1;
        see ``no_sync.py``). ``step()`` inside it raises."""
        refuse_no_sync(self.zero_optimization_stage(), self._inside_no_sync)
        self._inside_no_sync = True
        if self.optimizer is not None:
            self.optimizer.read_local_gradients(True)
        try:
            yield
        finally:
            self._inside_no_sync = False
            if self.optimizer is not None:
                self.optimizer.read_local_gradients(False)

    def allreduce_gradients(self, bucket_size=None) -> None:
        """DeepSpeed's public call: reduces (averages over the data-parallel ranks) the
        gradients of the backward passes so far. A backward at an accumulation boundary already
        reduced its gradients at every stage (DeepSpeed's backward calls this at its end), so
        that leaves nothing to do; what ``no_sync()`` blocks left on each rank is reduced now,
        at a boundary, instead of at ``step()``. Not inside a ``no_sync()`` block, whose point
        is that nothing is reduced; ``bucket_size`` is accepted for DeepSpeed's signature (the
        stage's reduce buckets are planned at initialize)."""
        if self.optimizer is None:
            raise RuntimeError(
                "engine.allreduce_gradients needs an optimizer (in the config or initialize)"
            )
        if self._inside_no_sync:
            raise RuntimeError(
                "engine.allreduce_gradients() inside engine.no_sync(): the block exists to keep "
                "the gradients unreduced; call it after the block"
            )
        if self._reduction_owed and self.is_gradient_accumulation_boundary():
            self._reduce_local_gradients()

    def _reduce_local_gradients(self) -> None:
        """Reduces what the backward passes accumulated unreduced, as the backward of an
        accumulation boundary would (stages 0/1: every parameter not reduced is handed over)."""
        self.optimizer.begin_backward(True)
        self.optimizer.end_backward()
        self._reduction_owed = False

    def _adopt_script_gradients(self) -> None:
        """``engine._backward_epilogue()`` after a script's own backward that the engine's output
        hooks did not see (a loss from a submodule's output): the gradients it left in ``.grad``
        are reduced as one backward's, taken as they are (``torch_backward.py``). Needs a forward
        since the last step, as ``engine.backward`` does; with no such gradient nothing counts
        as a backward (``step()`` then refuses)."""
        self._failed_step.check("engine._backward_epilogue()")
        self._call_order.before_backward()
        self._adopt_hand_set_gradients()

    def _adopt_hand_set_gradients(self) -> None:
        """``step()`` with no ``engine.backward()`` since the last step, after a script wrote the
        gradients into the parameters' ``.grad`` itself (DeepSpeed steps with them): they go
        through the stage as one backward's would (post-accumulate hooks, reduction at the
        boundary), taken as they are (not divided by the accumulation steps; under fp16 they
        are taken as loss-scaled, as DeepSpeed does). Only with no forward since the last step
        (``call_order.py``); not at ZeRO-3, whose parameters are partitioned; with no such
        gradient ``before_step`` raises."""
        if self.zero_optimization_stage() >= 3:
            return
        # Only parameters the stage trains: another's gradient would add nothing to the step.
        params = [p for p in self.module.parameters() if p.grad is not None and fragment_owner(p)]
        if not params:
            return
        grads = [p.grad for p in params]
        for param in params:
            param.grad = None
        self.optimizer.begin_backward(self.is_gradient_accumulation_boundary())
        # Backward through the leaves themselves: autograd accumulates each gradient and runs
        # the stage's post-accumulate hooks exactly as for a loss's backward.
        torch.autograd.backward(params, grads)
        self.optimizer.end_backward()
        self._call_order.after_backward()
        self._reduction_owed = False
