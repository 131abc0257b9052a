"""ZeRO-3 leaf modules (DeepSpeed's ``set_z3_leaf_modules`` and companions).

A module marked as a leaf is one ZeRO-3 fetch unit together with everything below it: the
parameters of its whole subtree are gathered before its forward (and before its backward) and
released together, and its descendants get no hooks of their own. This is what a Mixture-of-Experts
block wants: which experts run, and in which order, changes from batch to batch (and from rank to
rank), so per-expert units would make the recorded fetch order useless and, where ranks route
differently, make the ranks disagree on what to gather; as one unit, every rank gathers the same
parameters at the same point. transformers marks its MoE blocks this way.

The mark is read when an engine is built (``deepspeed_cpp.initialize``, the ZeRO-3 coordinator in
``runtime/zero/coordinator.py``): mark the model before initializing. Marking a model that already
has a live engine logs a warning, because that engine's units are already fixed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .logging import logger

__all__ = [
    "apply_zero_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]

_LEAF_ATTRIBUTE = "_z3_leaf"  # DeepSpeed's attribute name: code written for it may read it
# Set on each partitioned parameter of a leaf unit by the coordinator (DeepSpeed's name).
LEAF_PARAMETER_ATTRIBUTE = "ds_z3_leaf_module"


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is marked as a ZeRO-3 leaf."""
    return bool(getattr(module, _LEAF_ATTRIBUTE, False))


def z3_leaf_parameter(param: torch.nn.Parameter) -> bool:
    """Whether ``param`` is gathered as part of a leaf module's unit by a ZeRO-3 engine."""
    return hasattr(param, LEAF_PARAMETER_ATTRIBUTE)


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of ``model`` marked as leaves, in ``model.modules()`` order."""
    return [module for module in model.modules() if z3_leaf_module(module)]


def set_z3_leaf_module(module: torch.nn.Module, flag: bool) -> None:
    """Marks (or unmarks) one module."""
    setattr(module, _LEAF_ATTRIBUTE, bool(flag))


def set_z3_leaf_modules(
    model: torch.nn.Module,
    leaf_module_classes: Sequence[type | str],
    raise_if_not_found: bool = True,
) -> list[torch.nn.Module]:
    """Marks every module of ``model`` that is an instance of one of ``leaf_module_classes``
    (classes, or class names: bare or module-qualified) as a ZeRO-3 leaf; returns them. Raises
    ValueError when none matches, unless ``raise_if_not_found`` is False."""
    return _mark(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: torch.nn.Module,
    leaf_module_classes: Sequence[type | str],
    raise_if_not_found: bool = True,
) -> list[torch.nn.Module]:
    """Removes the leaf mark from the modules ``set_z3_leaf_modules`` would mark; returns them."""
    return _mark(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: torch.nn.Module,
    module_names: Sequence[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Marks (``flag``) the modules named in ``module_names`` (``model.named_modules()`` names);
    returns ``(modules, names not found)``. Raises ValueError naming the missing ones unless
    ``raise_if_not_found`` is False."""
    by_name = dict(model.named_modules())
    missing = [name for name in module_names if name not in by_name]
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing} in {type(model).__name__}")
    matched = [by_name[name] for name in module_names if name in by_name]
    _apply_marks(model, matched, flag)
    return matched, missing


def set_z3_leaf_modules_by_suffix(
    model: torch.nn.Module,
    module_name_suffixes: Sequence[str],
    flag: bool = True,
    raise_if_not_found: bool = True,
) -> tuple[list[torch.nn.Module], list[str]]:
    """Marks (``flag``) every module whose ``named_modules()`` name ends with one of
    ``module_name_suffixes``; returns ``(modules, suffixes that matched nothing)``, each module
    once. Raises ValueError naming the unmatched suffixes unless ``raise_if_not_found`` is
    False."""
    named = list(model.named_modules())
    matched: list[torch.nn.Module] = []
    missing = []
    for suffix in module_name_suffixes:
        hits = [module for name, module in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        matched.extend(m for m in hits if all(m is not seen for seen in matched))
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing} in {type(model).__name__}")
    _apply_marks(model, matched, flag)
    return matched, missing


def apply_zero_leaf_module_config(model: torch.nn.Module, leaf_config) -> list[torch.nn.Module]:
    """Marks the modules the ``zero_optimization.leaf_module`` section names (its ``classes``,
    ``names`` and ``name_suffixes``, each optional) as leaves; returns them, each once. The
    engine calls it as it is built, at every ZeRO stage, as DeepSpeed's does. Names given in
    the config that match nothing are warned about (the default classes, transformers' MoE
    blocks, are not: most models have none); None (no section) marks nothing."""
    if leaf_config is None:
        return []
    from ..runtime.zero.leaf_module_config import (  # plain data, no imports of its own
        DEFAULT_LEAF_MODULE_CLASSES,
        DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
        DEFAULT_LEAF_MODULE_NAMES,
    )

    matched: dict[int, torch.nn.Module] = {}
    customised = False
    if leaf_config.classes:
        for module in set_z3_leaf_modules(model, leaf_config.classes, raise_if_not_found=False):
            matched.setdefault(id(module), module)
        customised |= list(leaf_config.classes) != DEFAULT_LEAF_MODULE_CLASSES
    for field, wanted, mark, defaults in (
        ("names", leaf_config.names, set_z3_leaf_modules_by_name, DEFAULT_LEAF_MODULE_NAMES),
        (
            "name_suffixes",
            leaf_config.name_suffixes,
            set_z3_leaf_modules_by_suffix,
            DEFAULT_LEAF_MODULE_NAME_SUFFIXES,
        ),
    ):
        wanted = list(wanted)
        if not wanted:
            continue
        modules, missing = mark(model, wanted, flag=True, raise_if_not_found=False)
        for module in modules:
            matched.setdefault(id(module), module)
        if wanted != defaults:
            customised = True
            if missing:
                logger.warning(
                    "deepspeed_cpp: zero_optimization.leaf_module.%s %s match no module of %s",
                    field,
                    missing,
                    type(model).__name__,
                )
    if not matched and customised:
        logger.warning(
            "deepspeed_cpp: zero_optimization.leaf_module matched no module of %s; no module is "
            "marked as a ZeRO-3 leaf",
            type(model).__name__,
        )
    return list(matched.values())


def _apply_marks(model, modules, flag: bool) -> None:
    for module in modules:
        set_z3_leaf_module(module, flag)
    if modules and _has_live_engine(model):
        logger.warning(
            "deepspeed_cpp: ZeRO-3 leaf marks changed on a model that already has an engine: "
            "its ZeRO-3 fetch units were fixed when it was built; the marks apply to engines "
            "built from now on"
        )


def _mark(model, classes, flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    if isinstance(classes, (type, str)):
        classes = [classes]
    wrong = [c for c in classes if not isinstance(c, (type, str))]
    if wrong:
        raise TypeError(
            f"leaf_module_classes must hold module classes or class names, got {wrong!r}"
        )
    matched = [module for module in model.modules() if _matches(module, classes)]
    if not matched and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of {names} found in {type(model).__name__}")
    _apply_marks(model, matched, flag)
    return matched


def _matches(module: torch.nn.Module, classes) -> bool:
    cls = type(module)
    qualified = f"{cls.__module__}.{cls.__qualname__}"
    return any(
        (isinstance(c, type) and isinstance(module, c))
        or (isinstance(c, str) and c in (cls.__name__, qualified))
        for c in classes
    )


def _has_live_engine(model: torch.nn.Module) -> bool:
    engine = getattr(model, "_deepspeed_cpp_engine", None)  # a weak reference the engine sets
    return engine is not None and engine() is not None
