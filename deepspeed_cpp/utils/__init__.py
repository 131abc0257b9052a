"""Utilities under DeepSpeed's ``deepspeed.utils`` names: ``logger``, ``RepeatingLoader``,
``OnDevice``, and (on first use) the ZeRO tensor-fragment API and ``groups``.

Only ``logger`` is imported eagerly: the launcher imports this package (through
``deepspeed_cpp.utils.logging``) before it execs torchrun, and must not pay for a torch import
there (tests/test_launcher.py). The other names load on first access.
"""

from importlib import import_module

from .logging import logger

_LAZY = {"OnDevice": ".init_on_device", "RepeatingLoader": ".repeating_loader"}
_LAZY_MODULES = {"groups"}  # deepspeed.utils.groups without importing it by name

__all__ = ["OnDevice", "RepeatingLoader", "logger"]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
