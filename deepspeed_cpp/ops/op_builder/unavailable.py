"""Builders of DeepSpeed ops deepspeed_cpp does not have, under DeepSpeed's names, so that code
asking whether they can run (``FusedLambBuilder().is_compatible()``, DeepSpeed's tests through
``deepspeed.ops.__compatible_ops__``) gets "no" instead of an ImportError."""

from __future__ import annotations

from .builder import OpNotAvailableError


class _Unavailable:
    NAME = ""
    WHY = ""

    def is_compatible(self, verbose: bool = False):
        return False, self.WHY

    def load(self, verbose: bool = True):
        raise OpNotAvailableError(f"op '{self.NAME}' is not available: {self.WHY}")


class FusedLambBuilder(_Unavailable):
    NAME = "fused_lamb"
    WHY = "deepspeed_cpp has no LAMB optimizer (use Adam/AdamW, Adagrad or Lion)"
