"""Parameters a module's forward uses although another module owns them: ZeRO-3 gathers them
for that module too (its fetch unit takes them in, ``coordinator.py``). Re-exported under
DeepSpeed's path, ``deepspeed.zero`` / ``partition_parameters``.

The registry is DeepSpeed's: ``module._external_params`` maps ``id(parameter)`` to the
parameter (DeepSpeed's bound ``ds_external_parameters()`` accessor is left out: a method object
in every module's ``__dict__`` for a name no script was found calling). A ZeRO-3
engine gives every module of its model an empty registry when it is built (as DeepSpeed's
does), and its hooks register a parameter a submodule returns from its forward ("dangling": the
caller computes with it after the owner's forward ended) on the caller
(``register_returned_parameters``).
"""

from __future__ import annotations

import torch

_REGISTRY = "_external_params"  # DeepSpeed's attribute name: code written for it reads it


class NotAParameterError(TypeError, RuntimeError):
    """Raised for something other than a ``torch.nn.Parameter`` (a RuntimeError in DeepSpeed,
    a TypeError here before: both catch it)."""


def external_parameter_registry(module: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """``module``'s registry (``_external_params``), made empty on first use."""
    return module.__dict__.setdefault(_REGISTRY, {})


def registered_external_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters registered on ``module`` (none when it has no registry)."""
    return list(module.__dict__.get(_REGISTRY, {}).values())


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declares that ``module``'s forward uses ``parameter`` although another module owns it, so
    that ZeRO-3 gathers it for ``module`` too. Call it before ``deepspeed_cpp.initialize``:
    the engine forms its fetch units then."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise NotAParameterError(
            f"register_external_parameter expects a torch.nn.Parameter, got {type(parameter)}"
        )
    external_parameter_registry(module)[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Reverses ``register_external_parameter``; raises RuntimeError (as DeepSpeed) when
    ``parameter`` is not registered on ``module``."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise NotAParameterError(
            f"unregister_external_parameter expects a torch.nn.Parameter, got {type(parameter)}"
        )
    registry = module.__dict__.get(_REGISTRY, {})
    if id(parameter) not in registry:
        raise RuntimeError(
            f"unregister_external_parameter: the parameter of shape {tuple(parameter.shape)} is "
            f"not a registered external parameter of {type(module).__name__}"
        )
    del registry[id(parameter)]


def register_returned_parameters(module, returned, running) -> list[torch.nn.Parameter]:
    """DeepSpeed's dangling parameters: a parameter ``module``'s forward returned (``returned``:
    those of ``returned_parameters(output)`` that ZeRO-3 partitions) is used by the caller after
    ``module`` ended, so it is registered on the caller (``running[-1]``; ``running``: the
    modules whose forward is under way, outermost first) unless one of them has it already, and
    taken off ``module`` (which passed on one registered there). Returns those registered now."""
    registered = []
    for param in returned:
        if any(id(param) in external_parameter_registry(m) for m in running):
            continue
        register_external_parameter(running[-1], param)
        external_parameter_registry(module).pop(id(param), None)
        registered.append(param)
    return registered


def returned_parameters(output) -> list[torch.nn.Parameter]:
    """The parameters a module's forward returned, looked for as DeepSpeed's hooks look: the
    output itself, the items of a returned list or tuple, the tensor values of a returned dict
    or of an object's attributes (not nested deeper)."""
    if output is None:
        return []
    if isinstance(output, torch.Tensor):
        items = [output]
    elif isinstance(output, (list, tuple)):
        items = output
    else:
        fields = output if isinstance(output, dict) else getattr(output, "__dict__", {})
        items = [
            value
            for key, value in fields.items()
            if not (isinstance(key, str) and key.startswith("__"))
        ]
    return [item for item in items if isinstance(item, torch.nn.Parameter)]
