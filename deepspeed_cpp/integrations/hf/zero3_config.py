"""``HfDeepSpeedConfig`` and ``is_deepspeed_zero3_enabled()`` for code outside the Trainer.

The Hugging Face guide's non-Trainer pattern keeps a config object alive so that library code
can ask "is ZeRO-3 on?" and build models partitioned. transformers' own versions of these answer
for the ``deepspeed`` distribution (and import it when they say yes), so ours are separate:
while an ``HfDeepSpeedConfig`` is alive, ``deepspeed_cpp.hf.is_deepspeed_zero3_enabled()`` and
``deepspeed_cpp.hf.deepspeed_config()`` answer from it; transformers' answer stays False.
``TrainingArguments(deepspeed=...)`` keeps one alive too, as transformers' do.

Model construction under our ``zero.Init`` is explicit::

    ds = HfDeepSpeedConfig(ds_config)          # keep this object alive
    with ds.zero_init():                       # stage 3: parameters partitioned as built
        model = AutoModelForCausalLM.from_config(config)
    initialize_weights_zero3(model)            # the model's own init, on gathered parameters

A saved model goes straight into partitions with ``from_pretrained_zero3(AutoModel..., path)``
(pretrained_zero3.py).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from deepspeed_cpp.comm.collective_errors import named_collective
from deepspeed_cpp.runtime.config import DeepSpeedConfig

_current: weakref.ref | None = None


class HfDeepSpeedConfig:
    """A ds_config (path or dict, ``"auto"`` allowed) kept for the process: while this object is
    alive, ``is_deepspeed_zero3_enabled()`` and ``deepspeed_config()`` answer from it."""

    def __init__(self, config_file_or_dict: Any):
        parsed = DeepSpeedConfig.parse(config_file_or_dict)
        self.config: dict = parsed.raw
        stage = parsed.zero_optimization.stage
        self._stage = stage if isinstance(stage, int) else None
        global _current
        _current = weakref.ref(self)

    def is_zero3(self) -> bool:
        return self._stage == 3

    def is_offload(self) -> bool:
        """Whether the optimizer state or the parameters live off the device (CPU or NVMe)."""
        zero = self.config.get("zero_optimization", {})
        return any(
            isinstance(zero.get(key), dict) and zero[key].get("device") in ("cpu", "nvme")
            for key in ("offload_optimizer", "offload_param")
        )

    def zero_init(self):
        """A context in which models are built partitioned (``deepspeed_cpp.zero.Init`` with this
        config) at ZeRO-3; below stage 3 it does nothing."""
        if not self.is_zero3():
            return contextlib.nullcontext()
        from deepspeed_cpp import zero

        return zero.Init(config_dict_or_path=self.config)


def _live_config() -> HfDeepSpeedConfig | None:
    return _current() if _current is not None else None


def is_deepspeed_zero3_enabled() -> bool:
    """True while an ``HfDeepSpeedConfig`` at ZeRO stage 3 is alive (for deepspeed_cpp)."""
    live = _live_config()
    return live is not None and live.is_zero3()


def deepspeed_config() -> dict | None:
    """The live ``HfDeepSpeedConfig``'s config dict, or None."""
    live = _live_config()
    return live.config if live is not None else None


def initialize_weights_zero3(model) -> None:
    """Runs a transformers model's own weight initialisation on a model built under
    ``zero_init()``. Collective: every rank calls it.

    Submodules are partitioned as their ``__init__`` returns, so the initialisation transformers
    runs at the end of the model's ``__init__`` saw empty tensors (and marked the modules done):
    here each module's parameters are gathered, rank 0 initialises them with the model's
    ``_init_weights`` and the result is scattered back to the shards, one module at a time (the
    whole model is never gathered).
    """
    import torch
    import torch.distributed as dist
    from transformers import PreTrainedModel

    from deepspeed_cpp import zero

    writes = not dist.is_initialized() or dist.get_rank() == 0
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for tensor in list(module.parameters(recurse=False)) + list(module.buffers(recurse=False)):
            tensor.__dict__.pop("_is_hf_initialized", None)

    def initialise(module, owner: PreTrainedModel) -> None:
        for child in module.children():
            initialise(child, child if isinstance(child, PreTrainedModel) else owner)
        # _init_weights of a module may also write its direct children's parameters.
        params = list(module.parameters(recurse=False))
        for child in module.children():
            if not isinstance(child, PreTrainedModel):
                params += list(child.parameters(recurse=False))
        with zero.GatheredParameters(params, modifier_rank=0, enabled=bool(params)):
            if writes:
                owner._initialize_weights(module)

    initialise(model, model)
    model.tie_weights()
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Parameters below the persistence threshold stay whole on every rank (not gathered
        # above): rank 0's initialisation is sent to the others, as are the buffers.
        with torch.no_grad():
            with named_collective("broadcast of rank 0's initial weights (from_pretrained)"):
                for param in model.parameters():
                    if not (hasattr(param, "ds_id") and not param.ds_persist):
                        dist.broadcast(param.data, src=0)
                for buffer in model.buffers():
                    dist.broadcast(buffer.data, src=0)
