"""Opt-in, process-local ``import deepspeed`` alias for scripts that cannot change a line.

``deepspeed_cpp.compat.activate()`` (or ``python -m deepspeed_cpp.launcher --alias-deepspeed
script.py``, which activates it in every worker) makes, inside this one process:

- ``import deepspeed`` and ``import deepspeed.<sub>`` resolve to ``deepspeed_cpp`` and
  ``deepspeed_cpp.<sub>`` (the very same module objects), through a finder at the front of
  ``sys.meta_path``; a submodule deepspeed_cpp does not have raises ``ModuleNotFoundError`` naming
  the deepspeed_cpp module it looked for;
- ``importlib.metadata.version("deepspeed")`` / ``distribution("deepspeed")`` answer with
  ``ALIAS_VERSION`` (a metadata finder on the same object);
- accelerate's DeepSpeed mode, which transformers' ``Trainer`` takes for ``--deepspeed``, gets a
  gloo process group of the launcher's world size on a machine without a GPU, where it would
  otherwise count a world of one (``accelerate_cpu_backend.py``).

An unmodified Hugging Face script (``from transformers import Trainer, TrainingArguments``,
``--deepspeed ds_config.json``) then trains on deepspeed_cpp's engine: accelerate calls
``deepspeed.initialize`` and drives the engine through the DeepSpeed names it reads, which
deepspeed_cpp has under the same module paths (``deepspeed.checkpoint.utils``,
``deepspeed.runtime.lr_schedules``, ``deepspeed.ops.adam``, the engine's methods).

Nothing is written to disk: other processes, pip and site-packages never see a ``deepspeed``
distribution. Activation is refused when a real ``deepspeed`` is importable (or already
imported): two packages answering to one name in one process would make every error ambiguous.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import sys
from pathlib import Path

import deepspeed_cpp

from . import accelerate_cpu_backend

ALIAS_NAME = "deepspeed"
TARGET_NAME = "deepspeed_cpp"
# The environment variable the launcher sets so that every worker activates the alias (read by
# ``deepspeed_cpp.compat.bootstrap``, run before the user's script).
ENV_FLAG = "DEEPSPEED_CPP_ALIAS_DEEPSPEED"

# What importlib.metadata reports for "deepspeed" while the alias is active. The public part is
# the DeepSpeed release whose API and ds_config keys deepspeed_cpp is checked against (the one
# benchmarks/ compare with, 0.19.8), so version checks written against DeepSpeed (transformers'
# dep check wants >= 0.9.3, accelerate gates features on >= 0.16.4) compare as they would for it;
# the PEP 440 local label says, to anyone who prints it, that this is deepspeed_cpp, not DeepSpeed.
# Our own version alone ("0.1.0") would make transformers refuse with "deepspeed>=0.9.3 is
# required", a message that sends users to install the package the alias stands in for.
ALIAS_VERSION = f"0.19.8+deepspeed.cpp.{deepspeed_cpp.__version__}"


class RealDeepSpeedPresentError(RuntimeError):
    """``activate()`` found a real ``deepspeed`` package this process could import."""


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already-imported deepspeed_cpp module; importlib then files it under the
    ``deepspeed...`` name too. ``create_module`` returns the real module and importlib leaves its
    existing ``__name__``/``__spec__``/``__file__`` alone, so tracebacks still name
    deepspeed_cpp."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return importlib.import_module(self.target)

    def exec_module(self, module) -> None:
        """Nothing: the target module was executed when it was imported under its own name."""

    def get_code(self, fullname: str):
        """The target module's code object: ``runpy`` (``python -m deepspeed.x.y``) executes it
        afresh as ``__main__`` rather than importing it, and asks the loader for it."""
        target_loader = importlib.util.find_spec(self.target).loader
        get_code = getattr(target_loader, "get_code", None)
        if get_code is None:
            raise ImportError(f"{self.target} has no code to run as a script", name=fullname)
        return get_code(self.target)


class _AliasDistribution(importlib.metadata.Distribution):
    """The in-memory ``deepspeed`` distribution: METADATA only, no files, no entry points."""

    def read_text(self, filename: str) -> str | None:
        if filename in ("METADATA", "PKG-INFO"):
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {ALIAS_NAME}\n"
                f"Version: {ALIAS_VERSION}\n"
                "Summary: deepspeed_cpp answering to 'deepspeed' in this process only "
                "(deepspeed_cpp.compat.activate)\n"
            )
        return None

    def locate_file(self, path) -> Path:
        return Path(deepspeed_cpp.__file__).parent / path


class DeepSpeedAliasFinder(importlib.abc.MetaPathFinder):
    """``deepspeed[.x.y]`` -> ``deepspeed_cpp[.x.y]`` for imports and for importlib.metadata."""

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != ALIAS_NAME and not fullname.startswith(ALIAS_NAME + "."):
            return None
        target_name = TARGET_NAME + fullname[len(ALIAS_NAME) :]
        try:
            target_spec = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:
            target_spec = None
        if target_spec is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: the 'deepspeed' alias (deepspeed_cpp.compat) maps "
                f"it to {target_name!r}, which deepspeed_cpp does not have",
                name=fullname,
            )
        spec = importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(target_name),
            origin=target_spec.origin,
            is_package=target_spec.submodule_search_locations is not None,
        )
        # runpy gives a module run as __main__ its spec's origin as __file__; an import keeps
        # the target module's own attributes (importlib overrides none it already has).
        spec.has_location = target_spec.has_location
        if target_spec.submodule_search_locations is not None:
            # Submodule imports look in the parent's __path__; the finder answers them first.
            spec.submodule_search_locations = list(target_spec.submodule_search_locations)
        return spec

    def find_distributions(self, context=None):
        if context is None:
            context = importlib.metadata.DistributionFinder.Context()
        name = context.name
        if name is None or _normalized(name) == ALIAS_NAME:
            yield _AliasDistribution()


def _normalized(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


_finder: DeepSpeedAliasFinder | None = None


def is_active() -> bool:
    """Whether the alias is active in this process."""
    return _finder is not None


def find_real_deepspeed() -> str | None:
    """Where a real ``deepspeed`` would be imported from in this process (``None``: nowhere).

    Looked up with the alias inactive: an already-imported module, then the import system, then
    an installed distribution (metadata without an importable package still counts: something
    asked pip for DeepSpeed)."""
    loaded = sys.modules.get(ALIAS_NAME)
    if loaded is not None and loaded is not deepspeed_cpp:
        return f"already imported from {getattr(loaded, '__file__', None) or loaded!r}"
    spec = importlib.util.find_spec(ALIAS_NAME) if loaded is None else None
    if spec is not None:
        where = spec.origin or ", ".join(spec.submodule_search_locations or []) or "?"
        return f"importable from {where}"
    try:
        dist = importlib.metadata.distribution(ALIAS_NAME)
    except importlib.metadata.PackageNotFoundError:
        return None
    return f"installed as distribution deepspeed {dist.version} ({dist.locate_file('')})"


def activate() -> None:
    """Make ``import deepspeed`` mean deepspeed_cpp in this process (see the module docstring).

    Idempotent. Raises ``RealDeepSpeedPresentError`` when a real ``deepspeed`` is importable."""
    global _finder
    if _finder is not None:
        return
    real = find_real_deepspeed()
    if real is not None:
        raise RealDeepSpeedPresentError(
            f"deepspeed_cpp.compat.activate(): a real 'deepspeed' is {real}; the alias only "
            "stands in where DeepSpeed is absent. Use DeepSpeed as installed, or run in an "
            "environment without it (or write `import deepspeed_cpp as deepspeed`)"
        )
    _finder = DeepSpeedAliasFinder()
    sys.meta_path.insert(0, _finder)
    accelerate_cpu_backend.install()
    # importlib caches "no such module" answers per path entry; ours is new.
    importlib.invalidate_caches()


def deactivate() -> None:
    """Undo ``activate()``: the finder leaves ``sys.meta_path`` and the ``deepspeed...`` entries
    it made leave ``sys.modules`` (modules that imported them keep their references)."""
    global _finder
    if _finder is None:
        return
    sys.meta_path.remove(_finder)
    _finder = None
    accelerate_cpu_backend.uninstall()
    for name in [n for n in sys.modules if n == ALIAS_NAME or n.startswith(ALIAS_NAME + ".")]:
        if getattr(sys.modules[name], "__name__", "").startswith(TARGET_NAME):
            del sys.modules[name]
    importlib.invalidate_caches()


def activate_from_environment() -> bool:
    """Activate when the launcher asked for it (``DEEPSPEED_CPP_ALIAS_DEEPSPEED=1``)."""
    if os.environ.get(ENV_FLAG) == "1":
        activate()
        return True
    return False


__all__ = [
    "ALIAS_VERSION",
    "DeepSpeedAliasFinder",
    "RealDeepSpeedPresentError",
    "activate",
    "activate_from_environment",
    "deactivate",
    "find_real_deepspeed",
    "is_active",
]
