"""``deepspeed.OnDevice``: build a model's tensors on a chosen device and floating dtype.

``with OnDevice(dtype=torch.float16, device="meta"): model = MyModel()`` makes every tensor the
constructors create inside the block land on ``device``, floating-point ones in ``dtype``. Done
with torch's own device context (which covers every factory function and module constructor)
and the default dtype, rather than by replacing ``torch.empty`` and friends: nothing outside the
block, and no other thread's view of the ``torch`` module, is changed.
"""

from __future__ import annotations

import torch


class OnDevice:
    """Context manager: tensors created inside are on ``device``, floating ones in ``dtype``
    (``dtype`` None keeps the current default). ``enabled=False`` makes it do nothing."""

    def __init__(self, dtype: torch.dtype | None, device="meta", enabled: bool = True):
        if dtype is not None and not dtype.is_floating_point:
            raise ValueError(f"OnDevice: dtype must be a floating-point dtype, got {dtype}")
        self.dtype = dtype
        self.device = device
        self.enabled = enabled
        self._device_context = None
        self._saved_dtype = None

    def __enter__(self):
        if not self.enabled:
            return self
        self._saved_dtype = torch.get_default_dtype()
        if self.dtype is not None:
            torch.set_default_dtype(self.dtype)
        self._device_context = torch.device(self.device)
        self._device_context.__enter__()
        return self

    def __exit__(self, exc_type, exc_value, traceback):
        if not self.enabled:
            return
        self._device_context.__exit__(exc_type, exc_value, traceback)
        torch.set_default_dtype(self._saved_dtype)
