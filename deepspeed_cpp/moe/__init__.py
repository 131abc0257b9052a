"""DeepSpeed's ``deepspeed.moe`` namespace: the ``MoE`` layer (layer.py) with its gate
(gating.py), experts (experts.py) and token dispatch (dispatch.py); parameter-group helpers
(utils.py)."""

from . import layer, sharded_moe, utils
from .layer import MoE

__all__ = ["MoE", "layer", "sharded_moe", "utils"]
