"""deepspeed_cpp: the DeepSpeed training engine, re-implemented C++-first on PyTorch.

Scripts written for DeepSpeed run with ``import deepspeed_cpp as deepspeed``.
"""

from .utils.logging import logger

__version__ = "0.1.0"

# Everything but the logger loads on first use: ``python -m deepspeed_cpp.launcher`` only parses
# flags before it execs torchrun (which imports torch itself), so importing torch here would cost
# every launch seconds for nothing; the engine, ops and process-group helpers arrive on first
# touch, e.g. ``deepspeed_cpp.initialize`` or ``deepspeed_cpp.comm``.
_LAZY = {
    "initialize": ".runtime.initialize",
    "add_config_arguments": ".runtime.initialize",
    "DeepSpeedEngine": ".runtime.engine",
    "DeepSpeedConfig": ".runtime.config",
    "DeepSpeedConfigError": ".runtime.config",
    "RankDisagreementError": ".comm",
    "init_distributed": ".comm",
    "OnDevice": ".utils.init_on_device",
    "get_accelerator": ".accelerator",
    "tp_model_init": ".runtime.tensor_parallel",
    "version": ".git_version_info",
    "git_hash": ".git_version_info",
    "git_branch": ".git_version_info",
}
_LAZY_MODULES = (
    "accelerator",
    "checkpointing",
    "comm",
    "moe",
    "module_inject",
    "monitor",
    "ops",
    "optim",
    "pipe",
    "profiling",
    "runtime",
    "utils",
    "zero",
)


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'deepspeed_cpp' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | set(_LAZY_MODULES))


__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "OnDevice",
    "RankDisagreementError",
    "__version__",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "logger",
    "ops",
    "optim",
]
