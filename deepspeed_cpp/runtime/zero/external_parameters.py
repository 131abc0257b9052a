"""Parameters a module's forward uses although another module owns them: ZeRO-3 gathers them
for that module too (its fetch unit takes them in, ``coordinator.py``). Re-exported under
DeepSpeed's path, ``deepspeed.zero`` / ``partition_parameters``."""

from __future__ import annotations

import torch


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Declares that ``module``'s forward uses ``parameter`` although another module owns it, so
    that ZeRO-3 gathers it for ``module`` too. Call it before ``deepspeed_cpp.initialize``."""
    if not isinstance(parameter, torch.nn.Parameter):
        raise TypeError(
            f"register_external_parameter expects a torch.nn.Parameter, got {type(parameter)}"
        )
    external = module.__dict__.setdefault("_ds_external_params", {})
    external[id(parameter)] = parameter


def unregister_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    module.__dict__.get("_ds_external_params", {}).pop(id(parameter), None)
