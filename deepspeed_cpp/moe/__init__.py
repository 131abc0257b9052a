"""DeepSpeed's ``deepspeed.moe`` namespace. Mixture of Experts itself is not implemented: the
``MoE`` layer refuses to be built, and the parameter-group helpers pass non-MoE models through."""

from . import layer, utils
from .layer import MoE

__all__ = ["MoE", "layer", "utils"]
