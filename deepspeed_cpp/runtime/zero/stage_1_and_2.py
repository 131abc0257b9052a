"""DeepSpeed's module path for the ZeRO-2 memory estimators (``deepspeed.runtime.zero.
stage_1_and_2``); the stage 0-2 optimizer itself is ``partitioned_optimizer``."""

from .estimators import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)

__all__ = [
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
]
