"""``deepspeed.pipe``: pipeline parallelism (``deepspeed_cpp/runtime/pipe/``)."""

from __future__ import annotations

from ..runtime.pipe import (
    LayerSpec,
    PipeDataParallelTopology,
    PipelineError,
    PipelineModule,
    PipeModelDataParallelTopology,
    ProcessTopology,
    TiedLayerSpec,
)
from ..runtime.pipe.engine import PipelineEngine

__all__ = [
    "LayerSpec",
    "PipeDataParallelTopology",
    "PipeModelDataParallelTopology",
    "PipelineEngine",
    "PipelineError",
    "PipelineModule",
    "ProcessTopology",
    "TiedLayerSpec",
]
