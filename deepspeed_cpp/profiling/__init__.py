"""``deepspeed_cpp.profiling``: the flops profiler (``flops_profiler``), DeepSpeed's module path."""

from importlib import import_module

# ``import deepspeed; deepspeed.profiling.flops_profiler.get_model_profile(...)`` works in
# DeepSpeed (its engine imports the profiler); here the subpackage loads on first touch so that
# importing ``profiling`` stays cheap.
_LAZY_MODULES = {"flops_profiler"}


def __getattr__(name: str):
    if name in _LAZY_MODULES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY_MODULES)
