"""deepspeed_cpp: the DeepSpeed training engine, re-implemented C++-first on PyTorch.

Scripts written for DeepSpeed run with ``import deepspeed_cpp as deepspeed``.
"""

from . import ops, optim
from .utils.logging import logger

__version__ = "0.1.0"

__all__ = ["__version__", "logger", "ops", "optim"]
