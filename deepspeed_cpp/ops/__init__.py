"""Typed Python entry points to the native ops (one function per op) and their builders."""

from .cpu_adagrad import cpu_adagrad_step, cpu_adagrad_step_multi
from .cpu_adam import cpu_adam_step, cpu_adam_step_multi
from .cpu_lion import cpu_lion_step, cpu_lion_step_multi

__all__ = [
    "cpu_adagrad_step",
    "cpu_adagrad_step_multi",
    "cpu_adam_step",
    "cpu_adam_step_multi",
    "cpu_lion_step",
    "cpu_lion_step_multi",
]
