"""AutoTP training: the TP × DP groups (``groups.py``) and the set-up of a model (``setup.py``)."""

from .groups import ModelParallelUnit, model_parallel_unit
from .setup import tp_model_init

__all__ = ["ModelParallelUnit", "model_parallel_unit", "tp_model_init"]
