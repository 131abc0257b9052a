"""The training engine and what it is built from. Submodules load on first attribute access
(``deepspeed.runtime.utils.set_random_seed(...)`` as DeepSpeed scripts write it), so importing
the package costs nothing."""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name.startswith("_"):
        raise AttributeError(name)
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as error:
        if error.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
