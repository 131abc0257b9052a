"""Utilities under DeepSpeed's ``deepspeed.utils`` names: ``logger``, ``RepeatingLoader``,
``OnDevice``, the ZeRO tensor-fragment API (``tensor_fragment.py``), the ZeRO-3 leaf-module
marks (``z3_leaf_modules.py``: DeepSpeed's file is ``z3_leaf_module.py``, but here a submodule of
that name would shadow the function ``z3_leaf_module`` once anything imported it) and ``groups``.

Only ``logger`` is imported eagerly: the launcher imports this package (through
``deepspeed_cpp.utils.logging``) before it execs torchrun, and must not pay for a torch import
there (tests/test_launcher.py). The other names load on first access.
"""

from importlib import import_module

from .logging import logger

_TENSOR_FRAGMENT = (
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
)
_Z3_LEAF = (
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
)
# name -> the submodule that defines it
_LAZY = {
    "OnDevice": ".init_on_device",
    "RepeatingLoader": ".repeating_loader",
    **dict.fromkeys(_TENSOR_FRAGMENT, ".tensor_fragment"),
    **dict.fromkeys(_Z3_LEAF, ".z3_leaf_modules"),
}
_LAZY_MODULES = {"groups"}  # deepspeed.utils.groups without importing it by name

__all__ = ["logger", *sorted(_LAZY)]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if name in _LAZY_MODULES:
        return import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
