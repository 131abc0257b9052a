"""The one error a monitor back-end gives when its optional package is not installed."""

from __future__ import annotations

import importlib
import importlib.util


class MissingMonitorPackageError(ImportError):
    """A config section asks for a back-end whose package is not installed."""


def require(module: str, *, section: str, install: str) -> None:
    """Raises a named error unless ``module`` can be imported.

    Checked on every rank (without importing), so that a missing package stops every rank at
    the same point instead of only rank 0, which alone writes, while the others wait for it in
    the next collective."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise MissingMonitorPackageError(
            f"the '{section}' section of the DeepSpeed config is enabled but the Python package "
            f"'{install}' is not installed; install it (pip install {install}, or "
            f"pip install 'deepspeed_cpp[monitor]'), or set \"{section}\": "
            f'{{"enabled": false}}'
        )


def import_module(module: str, *, section: str, install: str):
    require(module, section=section, install=install)
    return importlib.import_module(module)
