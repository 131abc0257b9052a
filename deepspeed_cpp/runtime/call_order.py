"""The engine's API contract, checked where a mistake would otherwise train silently wrong.

A micro-step is ``forward`` (the engine or its module), ``backward``, ``step``, as in DeepSpeed:
``step()`` comes after every micro-step's backward and acts only at accumulation boundaries. So:

- ``backward()`` needs a forward of the model since the last ``step()`` (or since
  ``initialize``): a loss the model did not produce would train nothing, or the wrong thing.
  Several backwards after one forward (``retain_graph=True``, two losses) are fine.
- ``step()`` needs a ``backward()`` since the last ``step()``: a second ``step()`` after one
  backward would apply the same gradients twice at a boundary. Gradients a script wrote into
  the parameters' ``.grad`` itself, with no forward since the last step, count as a backward
  (DeepSpeed steps with them; the engine hands them to the stage first,
  ``DeepSpeedEngine._adopt_hand_set_gradients``): the step clears every ``.grad``, so a second
  step still finds none. After a forward they are refused as before: they would come from a
  backward the engine did not see, neither scaled (fp16) nor divided by the accumulation steps.
  A torch-style ``loss.backward()`` on the model's output is seen, and counts as a backward
  (``torch_backward.py``: hooks on the output do what ``engine.backward`` does).
- ``initialize(model_parameters=...)`` and an optimizer passed to it may only hold the model's
  parameters: the engine trains the model's parameters; a foreign one would be stepped while the
  model never changes (DeepSpeed refuses it with a KeyError).

A forward counts when the model's own module runs (a forward pre-hook on it), so a forward
through ``engine.module`` (as some integrations do) counts as one through the engine.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class BackwardWithoutForwardError(RuntimeError):
    """``engine.backward()`` was called with no forward of the model since the last step."""


class StepWithoutBackwardError(RuntimeError):
    """``engine.step()`` was called with no ``engine.backward()`` since the last step."""


class ForeignParameterError(ValueError):
    """A parameter given to ``initialize`` is not a parameter of the model."""


class CallOrder:
    """Remembers whether a forward and a backward ran since the last ``step()``."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._forward_seen = False
        self._backward_seen = False
        self._hook = module.register_forward_pre_hook(self._saw_forward)

    def _saw_forward(self, module, inputs) -> None:
        self._forward_seen = True

    def before_backward(self) -> None:
        if not self._forward_seen:
            raise BackwardWithoutForwardError(
                "engine.backward(loss): no forward of the model ran since the last "
                "engine.step() (or since initialize); compute the loss from engine(batch) in "
                "this micro-step, then backward, then engine.step()"
            )

    def after_backward(self) -> None:
        self._backward_seen = True

    def saw_backward(self) -> bool:
        return self._backward_seen

    def saw_forward(self) -> bool:
        return self._forward_seen

    def before_step(self, global_step: int) -> None:
        if not self._backward_seen:
            raise StepWithoutBackwardError(
                f"engine.step() at global step {global_step}: no engine.backward() since the "
                f"last engine.step() (or since initialize), so there are no new gradients to "
                f"step with; call forward, engine.backward(loss), then engine.step() once per "
                f"micro-step"
            )

    def after_step(self) -> None:
        self._forward_seen = False
        self._backward_seen = False

    def remove(self) -> None:
        self._hook.remove()


def refuse_foreign_parameters(
    module: torch.nn.Module, params: Iterable[torch.nn.Parameter], where: str
) -> None:
    """Raises ForeignParameterError for the first of ``params`` that is not one of
    ``module``'s parameters; ``where`` names the list (``model_parameters``)."""
    own = {id(p) for p in module.parameters()}
    for index, param in enumerate(params):
        if id(param) not in own:
            shape = tuple(getattr(param, "ds_shape", None) or getattr(param, "shape", ()))
            raise ForeignParameterError(
                f"initialize(): {where}[{index}] (a {type(param).__name__} of shape {shape}, "
                f"dtype {getattr(param, 'dtype', None)}) is not a parameter of the model: the "
                f"engine trains the model's own parameters, so this one would be stepped while "
                f"the model never changes; pass model.parameters() (or a subset of them)"
            )
