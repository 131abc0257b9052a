"""How each native op library is described, built ahead of time, or compiled on first use.

This package imports nothing from the rest of ``deepspeed_cpp`` so that ``setup.py`` can load it
straight from the source tree to pre-build ops.
"""

from .aio import AsyncIOBuilder
from .builder import OpBuilder, OpNotAvailableError
from .cpu_adagrad import CPUAdagradBuilder
from .cpu_adam import CPUAdamBuilder
from .cpu_lion import CPULionBuilder
from .fused_adam import FusedAdamBuilder, FusedAdamHostBuilder
from .moe import MoEBuilder, MoECudaBuilder
from .pin_memory import PinMemoryBuilder
from .registry import RegistryBuilder
from .unavailable import FusedLambBuilder
from .zero import ZeroBuilder

# Every op family, by the name its DS_BUILD_<NAME> flag and its library carry.
ALL_OPS: dict[str, type[OpBuilder]] = {
    CPUAdamBuilder.NAME: CPUAdamBuilder,
    CPUAdagradBuilder.NAME: CPUAdagradBuilder,
    CPULionBuilder.NAME: CPULionBuilder,
    FusedAdamBuilder.NAME: FusedAdamBuilder,
    ZeroBuilder.NAME: ZeroBuilder,
    AsyncIOBuilder.NAME: AsyncIOBuilder,
    MoEBuilder.NAME: MoEBuilder,
    MoECudaBuilder.NAME: MoECudaBuilder,
}

__all__ = [
    "ALL_OPS",
    "AsyncIOBuilder",
    "CPUAdagradBuilder",
    "CPUAdamBuilder",
    "CPULionBuilder",
    "FusedAdamBuilder",
    "FusedAdamHostBuilder",
    "FusedLambBuilder",
    "MoEBuilder",
    "MoECudaBuilder",
    "OpBuilder",
    "OpNotAvailableError",
    "PinMemoryBuilder",
    "RegistryBuilder",
    "ZeroBuilder",
]
