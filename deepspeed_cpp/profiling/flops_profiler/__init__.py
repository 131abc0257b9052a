"""``deepspeed.profiling.flops_profiler``: FlopsProfiler and get_model_profile, DeepSpeed's API."""

from .profiler import FlopsProfiler, get_model_profile
from .units import flops_to_string, macs_to_string, number_to_string, params_to_string

__all__ = [
    "FlopsProfiler",
    "flops_to_string",
    "get_model_profile",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]
