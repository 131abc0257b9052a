"""deepspeed_cpp: the DeepSpeed training engine, re-implemented C++-first on PyTorch.

Scripts written for DeepSpeed run with ``import deepspeed_cpp as deepspeed``.
"""

from . import comm, ops, optim
from .comm import init_distributed
from .utils.logging import logger

__version__ = "0.1.0"

# The engine and its config stack load on first use, so that importing the package (for the ops
# or the report command) stays light.
_LAZY = {
    "initialize": ".runtime.initialize",
    "add_config_arguments": ".runtime.initialize",
    "DeepSpeedEngine": ".runtime.engine",
}
_LAZY_MODULES = ("accelerator", "moe", "runtime", "utils", "zero")


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'deepspeed_cpp' has no attribute '{name}'")


__all__ = [
    "DeepSpeedEngine",
    "__version__",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "logger",
    "ops",
    "optim",
]
