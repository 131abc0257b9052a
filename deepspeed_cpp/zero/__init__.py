"""``deepspeed.zero``'s names: ZeRO-3 model construction and parameter gathering.

``Init`` partitions parameters as modules are built; ``GatheredParameters`` makes partitioned
parameters whole inside a ``with`` block (optionally writing one rank's changes back);
``register_external_parameter`` declares a parameter a module uses without owning it.
"""

from ..runtime.zero.partition_parameters import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    register_external_parameter,
    unregister_external_parameter,
)
from ..runtime.zero.tiling import TiledLinear, TiledLinearReturnBias

__all__ = [
    "GatheredParameters",
    "Init",
    "TiledLinear",
    "TiledLinearReturnBias",
    "ZeroParamStatus",
    "register_external_parameter",
    "unregister_external_parameter",
]
