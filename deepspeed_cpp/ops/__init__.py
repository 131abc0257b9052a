"""Typed Python entry points to the native ops (one function per op) and their builders."""

from .cpu_adam import cpu_adam_step, cpu_adam_step_multi

__all__ = ["cpu_adam_step", "cpu_adam_step_multi"]
