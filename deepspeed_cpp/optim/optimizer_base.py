"""The torch.optim.Optimizer our optimizers derive from: torch's, except that building one does
not import torch._dynamo.

torch wraps ``Optimizer.add_param_group`` (which its constructor calls once per group) so that
dynamo does not trace it, and the wrapper imports torch._dynamo at its first call: ~1.8 s of a
process's start on a 2-core host (``deepspeed_cpp.initialize`` took 2.15 s of which 1.8 s was
that import, for a model of three layers). While torch._dynamo is not imported, nothing can be
tracing the call, so the unwrapped function does the same; once it is imported, torch's wrapper
runs as before.
"""

from __future__ import annotations

import sys

import torch

_WRAPPED_ADD_PARAM_GROUP = torch.optim.Optimizer.add_param_group
# functools.wraps keeps torch's own function here; an older torch without the wrapper has none.
_PLAIN_ADD_PARAM_GROUP = getattr(_WRAPPED_ADD_PARAM_GROUP, "__wrapped__", _WRAPPED_ADD_PARAM_GROUP)


class OptimizerBase(torch.optim.Optimizer):
    def add_param_group(self, param_group: dict) -> None:
        if "torch._dynamo" in sys.modules:
            _WRAPPED_ADD_PARAM_GROUP(self, param_group)
        else:
            _PLAIN_ADD_PARAM_GROUP(self, param_group)
