"""``deepspeed.pipe``: importable, not yet implemented (pipeline parallelism is issue 28).

The names exist so that ``from deepspeed.pipe import PipelineModule, LayerSpec`` at the top of a
script or test module that never builds a pipeline does not stop it; building one (constructing
any of these classes) raises ``PipelineParallelismNotImplementedError`` naming the issue. Classes
that subclass them may be defined freely.
"""

from __future__ import annotations

PIPELINE_ISSUE = "issue 28 (pipeline parallelism, deepspeed.pipe)"


class PipelineParallelismNotImplementedError(NotImplementedError):
    """Pipeline parallelism was used; deepspeed_cpp does not have it yet."""


class _NotImplementedYet:
    def __init__(self, *args, **kwargs):
        raise PipelineParallelismNotImplementedError(
            f"deepspeed.pipe.{type(self).__name__}: pipeline parallelism is not implemented in "
            f"deepspeed_cpp yet ({PIPELINE_ISSUE}); train the model as one module with "
            "deepspeed.initialize(model=..., config=...) and ZeRO instead"
        )


class PipelineModule(_NotImplementedYet):
    """DeepSpeed's pipeline-parallel module (not implemented yet: see the module docstring)."""


class LayerSpec(_NotImplementedYet):
    """DeepSpeed's lazily built pipeline layer (not implemented yet)."""


class TiedLayerSpec(LayerSpec):
    """DeepSpeed's pipeline layer tied across stages (not implemented yet)."""


__all__ = [
    "LayerSpec",
    "PipelineModule",
    "PipelineParallelismNotImplementedError",
    "TiedLayerSpec",
]
