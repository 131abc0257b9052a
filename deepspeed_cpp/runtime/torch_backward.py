"""Torch-style backward: ``loss.backward()`` on a loss computed from the model's output, in place
of ``engine.backward(loss)``, then ``engine.step()`` (DeepSpeed 0.19's contract; scripts written
for plain torch loops or accelerate do this, and DeepSpeed's multiple-model tests call
``loss.backward()`` and then the engine's ``_backward_epilogue()``).

The contract, as DeepSpeed 0.19.8 defines it and this engine follows it:

- Through the engine (``out = engine(batch)``): a hook on every output tensor runs the backward
  prologue when the first output gradient arrives (before any parameter gradient: the stage
  starts its reduction exactly as in ``engine.backward``), has each parameter's gradient divided
  by the gradient-accumulation steps (``engine.backward`` divides the loss; DeepSpeed divides at
  the outputs, which divides twice where one output is computed from another, as a model's loss
  from its logits: this engine divides at the parameters, once, also those of a reentrant
  checkpoint, whose backward runs as a graph task nested in the outer one), and queues the epilogue
  on autograd's engine, so it runs when the backward finishes (the last reductions, the backward
  counted for ``step()``'s call-order check). Nothing else needs calling; a ``_backward_epilogue()``
  after it does nothing.
  - fp16 loss scaling is not applied by the hook: the loss must come through
    ``engine.scale(loss)`` (the current loss scale), else the backward is refused with
    "Loss scaling is required ..." (DeepSpeed refuses it after the backward, for a dynamic scale
    only; this engine refuses it before any gradient is reduced, for any scale other than 1: an
    unscaled gradient would be unscaled once more at the step, silently).
  - ZeRO stage 0 refuses it ("Direct calls to tensor.backward() are not supported ..."), as
    DeepSpeed does (its stage-0 optimizers have no backward hooks): use ``engine.backward``.
- Through the wrapped module (``out = engine.module(batch)``, as DeepSpeed's multiple-model
  test does): DeepSpeed installs no hook there; the gradients are taken as they are (not divided
  by the accumulation steps; under fp16 taken as loss-scaled) and the script calls
  ``engine._backward_epilogue()`` to reduce them. This engine hooks the module's output as well,
  so the stage reduces during that backward as during any other (same values), with the same
  meaning: no division, no scale check, at every stage; the epilogue still runs by itself, and the
  script's ``_backward_epilogue()`` then does nothing.
- Inside ``engine.backward(loss)`` the hooks do nothing: it scales, divides and reduces itself.
- Each backward pass (a new autograd graph task) over the same outputs (``retain_graph=True``)
  is a backward of its own: prologue, division and epilogue again.
"""

from __future__ import annotations

import torch


class TorchBackwardError(RuntimeError):
    """``loss.backward()`` on the engine's output where the engine cannot take it."""


def _output_tensors(output, found: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in ``output`` (tensor, tuple, list, dict, dataclass-like ``ModelOutput``)
    that carry an autograd graph."""
    if isinstance(output, torch.Tensor):
        if output.grad_fn is not None:
            found.append(output)
    elif isinstance(output, (tuple, list)):
        for item in output:
            _output_tensors(item, found)
    elif isinstance(output, dict):  # transformers' ModelOutput is a dict too
        for item in output.values():
            _output_tensors(item, found)
    return found


def _current_graph_task() -> int:
    return torch._C._current_graph_task_id()


class TorchBackward:
    """One engine's torch-style backward: the output hooks, and where a backward pass stands.

    ``engine`` is the DeepSpeedEngine (its stage, call order, accumulation steps, loss scaler);
    ``watch`` installs the forward hook on its module (the pipeline engine runs its own
    backward passes and does not)."""

    def __init__(self, engine, module: torch.nn.Module, watch: bool) -> None:
        self._engine = engine
        self.inside_engine_forward = False
        self.inside_engine_backward = 0
        self.scaled_by_engine = False  # engine.scale(loss) since the last prologue
        # The graph task whose prologue ran and whose epilogue is still to come (None: none).
        self._open_task: int | None = None
        # The last backward's epilogue ran by itself: the script's _backward_epilogue() is void.
        self.epilogue_ran = False
        self._hook = module.register_forward_hook(self._watch_output) if watch else None
        # Division by the accumulation steps, at the parameters (see _divide_at_parameters):
        # the graph task it applies to, and the hooks (installed at the first torch-style
        # backward through the engine with more than one accumulation step).
        self._dividing_task: int | None = None
        self._param_hooks: list | None = None

    def remove(self) -> None:
        for handle in ([self._hook] if self._hook is not None else []) + (self._param_hooks or []):
            handle.remove()
        self._hook, self._param_hooks = None, None

    # --- forward: hook the output ------------------------------------------------------------
    def _watch_output(self, module, inputs, output) -> None:
        if not torch.is_grad_enabled() or self._engine.optimizer is None:
            return
        tensors = _output_tensors(output, [])
        if not tensors:
            return
        through_engine = self.inside_engine_forward
        for tensor in tensors:
            tensor.register_hook(self._make_hook(through_engine))

    def _make_hook(self, through_engine: bool):
        def hook(grad: torch.Tensor) -> None:
            if self.inside_engine_backward or torch._C._are_functorch_transforms_active():
                return  # engine.backward scaled and divided the loss; torch.func: no step
            task = _current_graph_task()
            if task != self._open_task:
                self._prologue(task, through_engine)

        return hook

    def _divide_at_parameters(self) -> None:
        """Divides each parameter's gradient by the accumulation steps as it reaches the
        parameter, in a torch-style backward through the engine's output. Not at the outputs:
        an output computed from another one (a model returning its loss and the logits it came
        from) would divide the gradient flowing through both twice."""

        def divide(grad: torch.Tensor) -> torch.Tensor:
            # Any graph task while the dividing backward is open: a reentrant checkpoint runs
            # its segment's backward as a task nested in it, whose gradients are this
            # backward's all the same (only one backward runs at a time; engine.backward, which
            # divides its loss itself, never opens one).
            if self._dividing_task is None or self.inside_engine_backward:
                return grad
            return grad / self._engine.gradient_accumulation_steps()

        params = [p for p in self._engine.module.parameters() if p.requires_grad]
        self._param_hooks = [p.register_hook(divide) for p in params]

    # --- backward ------------------------------------------------------------------------------
    def _prologue(self, task: int, through_engine: bool) -> None:
        engine = self._engine
        if through_engine:
            refuse_unsupported(engine, self.scaled_by_engine)
        engine._failed_step.check("loss.backward()")
        engine._call_order.before_backward()
        self.scaled_by_engine = False
        self.epilogue_ran = False
        engine._begin_stage_backward()
        self._open_task = task
        divides = through_engine and engine.gradient_accumulation_steps() > 1
        if divides and self._param_hooks is None:
            # Installed at the first torch-style backward that divides, before any parameter's
            # gradient is computed (this runs at the first output gradient): a script that only
            # calls engine.backward never pays a Python hook per parameter per backward.
            self._divide_at_parameters()
        self._dividing_task = task if divides else None
        torch.autograd.Variable._execution_engine.queue_callback(self._epilogue)

    def _epilogue(self) -> None:
        self._open_task, self._dividing_task = None, None
        self._engine._end_stage_backward()  # sets epilogue_ran

    def after_step(self) -> None:
        """A step ends what the last backward and ``engine.scale`` left: a script's
        ``_backward_epilogue()`` after it reduces again, and the next loss must be scaled again."""
        self.epilogue_ran = False
        self.scaled_by_engine = False
        self._dividing_task = None  # a backward that raised part-way never ran its epilogue

    def script_epilogue(self) -> None:
        """``engine._backward_epilogue()`` called by the script: void after a backward whose
        epilogue ran by itself; else the gradients the script's own backward left in the
        parameters' ``.grad`` (a loss the output hooks did not see) are reduced as one
        backward's."""
        if self.epilogue_ran:
            self.epilogue_ran = False
            return
        self._engine._adopt_script_gradients()


def refuse_unsupported(engine, scaled: bool) -> None:
    """Raises TorchBackwardError where a ``loss.backward()`` through the engine's output cannot
    train as ``engine.backward(loss)`` would (see the module docstring)."""
    if engine.zero_optimization_stage() == 0:
        raise TorchBackwardError(
            "Direct calls to tensor.backward() are not supported in this configuration "
            "(ZeRO stage 0, as in DeepSpeed): use engine.backward(loss) instead, or set "
            "zero_optimization.stage to 1, 2 or 3"
        )
    scaler = engine.loss_scaler
    if scaler is not None and not scaled and (scaler.dynamic or scaler.loss_scale != 1.0):
        raise TorchBackwardError(
            f"Loss scaling is required for this configuration (fp16, loss scale "
            f"{scaler.loss_scale}), but backward() was called directly on an unscaled loss: use "
            f"engine.backward(loss), or engine.scale(loss).backward()"
        )
