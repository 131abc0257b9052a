"""DeepSpeed's ``deepspeed.utils.pin_memory``: its native (``mlock``) pinned-memory backend,
selected by ``DS_PIN_MEMORY_BACKEND=native``. deepspeed_cpp pins with torch only, so there is no
native backend: ``get_active_native_pinned_memory()`` is None, as in DeepSpeed without it."""

from __future__ import annotations


def get_active_native_pinned_memory():
    """The active native pinned-memory backend: none here (torch pins host memory)."""
    return None
