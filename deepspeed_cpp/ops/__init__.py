"""Typed Python entry points to the native ops (one function per op) and their builders."""

from .cpu_adagrad import cpu_adagrad_step, cpu_adagrad_step_multi
from .cpu_adam import cpu_adam_step, cpu_adam_step_multi
from .cpu_lion import cpu_lion_step, cpu_lion_step_multi


def __getattr__(name: str):
    # DeepSpeed's ``deepspeed.ops.__compatible_ops__`` (op -> can be built or loaded here); worked
    # out on first access, never by compiling (``git_version_info.py``).
    if name == "__compatible_ops__":
        from ..git_version_info import compatible_ops

        return compatible_ops
    raise AttributeError(f"module 'deepspeed_cpp.ops' has no attribute '{name}'")


__all__ = [
    "cpu_adagrad_step",
    "cpu_adagrad_step_multi",
    "cpu_adam_step",
    "cpu_adam_step_multi",
    "cpu_lion_step",
    "cpu_lion_step_multi",
]
