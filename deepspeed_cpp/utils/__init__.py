"""Utilities under DeepSpeed's ``deepspeed.utils`` names: ``logger``, ``RepeatingLoader``,
``OnDevice``, the ZeRO tensor-fragment API (``tensor_fragment.py``), the ZeRO-3 leaf-module
marks (``z3_leaf_module.py``) and ``groups``."""

from .init_on_device import OnDevice
from .logging import logger
from .repeating_loader import RepeatingLoader
from .tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from .z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)

__all__ = [
    "OnDevice",
    "RepeatingLoader",
    "get_z3_leaf_modules",
    "logger",
    "safe_get_full_fp32_param",
    "safe_get_full_grad",
    "safe_get_full_optimizer_state",
    "safe_get_local_fp32_param",
    "safe_get_local_grad",
    "safe_get_local_optimizer_state",
    "safe_set_full_fp32_param",
    "safe_set_full_grad",
    "safe_set_full_optimizer_state",
    "safe_set_local_fp32_param",
    "safe_set_local_grad",
    "safe_set_local_optimizer_state",
    "safe_update_full_grad_vectorized",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]
