"""Pipeline parallelism: ``PipelineModule`` split into stages over a process topology, run by
``PipelineEngine`` with 1F1B schedules (``deepspeed.runtime.pipe`` in DeepSpeed)."""

from .module import LayerSpec, PipelineError, PipelineModule, TiedLayerSpec
from .schedule import InferenceSchedule, TrainSchedule
from .topology import (
    PipeDataParallelTopology,
    PipelineParallelGrid,
    PipeModelDataParallelTopology,
    ProcessTopology,
)

__all__ = [
    "InferenceSchedule",
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineError",
    "PipelineModule",
    "PipelineParallelGrid",
    "ProcessTopology",
    "TiedLayerSpec",
    "TrainSchedule",
]
