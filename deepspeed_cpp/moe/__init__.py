"""DeepSpeed's ``deepspeed.moe`` namespace: the ``MoE`` layer (layer.py) with its gate
(gating.py), experts (experts.py) and token dispatch (dispatch.py); parameter-group helpers
(utils.py)."""

from . import layer, utils
from .layer import MoE

__all__ = ["MoE", "layer", "utils"]
