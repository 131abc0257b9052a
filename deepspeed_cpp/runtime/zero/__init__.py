"""ZeRO: partitioning of optimizer state (stage 1), gradients (stage 2) and parameters (stage 3)."""


def __getattr__(name: str):
    # DeepSpeed's ``from deepspeed.runtime.zero import ZeroParamStatus``, loaded on first use.
    if name == "ZeroParamStatus":
        from .partition_parameters import ZeroParamStatus

        return ZeroParamStatus
    if name in ("TiledLinear", "TiledLinearReturnBias"):
        from . import tiling

        return getattr(tiling, name)
    if name == "unwrap_model_for_generation":
        from .generation import unwrap_model_for_generation

        return unwrap_model_for_generation
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
