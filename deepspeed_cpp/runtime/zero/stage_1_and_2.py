"""DeepSpeed's module path for the stage 1-2 optimizer's class name (``DeepSpeedZeroOptimizer``,
for ``isinstance``; ours is ``partitioned_optimizer.ZeroPartitionedOptimizer``) and the ZeRO-2
memory estimators."""

from .estimators import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
)
from .optimizer_kinds import DeepSpeedZeroOptimizer

__all__ = [
    "DeepSpeedZeroOptimizer",
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
]
