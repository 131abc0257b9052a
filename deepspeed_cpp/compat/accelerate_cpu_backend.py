"""Under the alias: accelerate's DeepSpeed mode on a machine without a GPU gets gloo and the real
world size.

accelerate 1.15's ``PartialState`` chooses its process-group backend in ``_prepare_backend``: an
accelerator's (nccl, hccl, ...) or, only when built with ``cpu=True``, gloo. transformers builds
the state for ``--deepspeed`` with ``cpu`` False (``use_cpu=True`` would turn DeepSpeed off), so
on a machine without a GPU the state gets no backend and counts a world of one on every rank:
the data is not sharded and the batch-size rule fails (``8 != 4 * 2 * 2``). DeepSpeed itself
fails the same way here.

While the alias is active, that one choice is wrapped: where accelerate found no backend for a
DeepSpeed run that a launcher started (``LOCAL_RANK`` set; accelerate then sets the group up
through ``deepspeed.comm.init_distributed``, ours), the answer becomes gloo. accelerate goes on
as it would with any backend: it initialises the group (or keeps one already there) and reads
rank and world size from it; the device stays the CPU. The wrapper is put on ``accelerate.state``
when that module is imported (a finder at the front of ``sys.meta_path`` wraps its loader) or at
once when it already is, and ``uninstall()`` takes both away. Nothing else of accelerate changes,
and a process without the alias never sees any of it.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys

STATE_MODULE = "accelerate.state"


def _deepspeed_launch_without_backend(backend, cpu: bool) -> bool:
    """accelerate found no backend for a launched (``LOCAL_RANK``) DeepSpeed run on the CPU."""
    return (
        backend is None
        and not cpu
        and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        and int(os.environ.get("LOCAL_RANK", "-1")) != -1
    )


def _wrap_backend_choice(state_module) -> None:
    partial_state = state_module.PartialState
    original = partial_state._prepare_backend
    if getattr(original, "_deepspeed_cpp_original", None) is not None:
        return  # already wrapped

    @functools.wraps(original)
    def prepare_backend(self, cpu: bool = False, sagemaker_dp=False, backend=None):
        chosen, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if _deepspeed_launch_without_backend(chosen, cpu):
            # distributed_type stays NO (the device is the CPU); accelerate switches it to
            # DEEPSPEED itself once the group is up.
            return "gloo", distributed_type
        return chosen, distributed_type

    prepare_backend._deepspeed_cpp_original = original
    partial_state._prepare_backend = prepare_backend


def _unwrap_backend_choice(state_module) -> None:
    partial_state = state_module.PartialState
    original = getattr(partial_state._prepare_backend, "_deepspeed_cpp_original", None)
    if original is not None:
        partial_state._prepare_backend = original


class _WrapAfterExec(importlib.abc.Loader):
    """accelerate.state's own loader, then the wrapper; anything else asked of the loader
    (``get_source``, ...) goes to accelerate's."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _wrap_backend_choice(module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _StateModuleWatcher(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path=None, target=None):
        if fullname != STATE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _WrapAfterExec(spec.loader)
        return spec


_watcher: _StateModuleWatcher | None = None


def install() -> None:
    """Wraps accelerate's backend choice now (accelerate.state imported) or on its import."""
    global _watcher
    loaded = sys.modules.get(STATE_MODULE)
    if loaded is not None:
        _wrap_backend_choice(loaded)
    elif _watcher is None:
        _watcher = _StateModuleWatcher()
        sys.meta_path.insert(0, _watcher)


def uninstall() -> None:
    """Removes the watcher and restores accelerate's own backend choice."""
    global _watcher
    if _watcher is not None:
        sys.meta_path.remove(_watcher)
        _watcher = None
    loaded = sys.modules.get(STATE_MODULE)
    if loaded is not None:
        _unwrap_backend_choice(loaded)
