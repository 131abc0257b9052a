"""How each native op library is described, built ahead of time, or compiled on first use.

This package imports nothing from the rest of ``deepspeed_cpp`` so that ``setup.py`` can load it
straight from the source tree to pre-build ops.
"""

from .builder import OpBuilder, OpNotAvailableError
from .cpu_adam import CPUAdamBuilder
from .registry import RegistryBuilder
from .zero import ZeroBuilder

# Every op family, by the name its DS_BUILD_<NAME> flag and its library carry.
ALL_OPS: dict[str, type[OpBuilder]] = {
    CPUAdamBuilder.NAME: CPUAdamBuilder,
    ZeroBuilder.NAME: ZeroBuilder,
}

__all__ = [
    "ALL_OPS",
    "CPUAdamBuilder",
    "OpBuilder",
    "OpNotAvailableError",
    "RegistryBuilder",
    "ZeroBuilder",
]
