"""``TrainingArguments`` and ``Seq2SeqTrainingArguments`` that take ``deepspeed=`` for us.

transformers treats a ``deepspeed`` argument as a request for the ``deepspeed`` distribution (it
imports it, and builds accelerate's DeepSpeed plugin). These subclasses keep the field, so
``TrainingArguments(deepspeed=...)`` and ``--deepspeed ds_config.json`` through
``HfArgumentParser`` read as before, but hide it from transformers while it sets itself up, and
fill the config's ``"auto"`` values from the arguments instead (``config_filling``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from functools import cached_property

import transformers

from deepspeed_cpp.runtime.config import DeepSpeedConfig

from .config_filling import fill_from_arguments
from .process_state import launched_without_gpu
from .zero3_config import HfDeepSpeedConfig


class _EngineArgumentsMixin:
    """What both argument classes add: the hidden ``deepspeed`` field and the filled config."""

    def __post_init__(self):
        with self._deepspeed_hidden():
            super().__post_init__()
        self.deepspeed_cpp_config = None
        self.deepspeed_cpp_hf_config = None
        if self.deepspeed:
            # The config is read and validated now (a bad key fails here, not at train()),
            # "auto" allowed; what is filled here comes from the arguments alone.
            parsed = DeepSpeedConfig.parse(self.deepspeed)
            self.deepspeed_cpp_config = fill_from_arguments(parsed.raw, self, self.world_size)
            # Kept alive with the arguments: is_deepspeed_zero3_enabled() answers from it.
            self.deepspeed_cpp_hf_config = HfDeepSpeedConfig(self.deepspeed_cpp_config)

    def refill_deepspeed_cpp_config(self, per_device_train_batch_size: int | None = None) -> dict:
        """The ds_config filled afresh from the arguments as they are now: hyper-parameter search
        sets a trial's values on the arguments, and the config's ``"auto"`` keys must follow.
        ``per_device_train_batch_size``: the batch ``auto_find_batch_size`` settled on, which
        the arguments do not hold (the Trainer keeps it); the config's batch keys then have to
        be ``"auto"`` (or left out), as a fixed number could not follow it."""
        raw = DeepSpeedConfig.parse(self.deepspeed).raw
        if per_device_train_batch_size is None:
            return fill_from_arguments(raw, self, self.world_size)
        if per_device_train_batch_size != self.per_device_train_batch_size:
            sized_by_batch = ("train_micro_batch_size_per_gpu", "train_batch_size")
            fixed = [f"{k!r} = {raw[k]!r}" for k in sized_by_batch if raw.get(k, "auto") != "auto"]
            if fixed:
                raise ValueError(
                    "auto_find_batch_size lowered the per-device batch to "
                    f"{per_device_train_batch_size} after an out-of-memory error, but the "
                    f'ds_config fixes {", ".join(fixed)}: expected "auto" (or no such key) so '
                    "that the engine is rebuilt for the new batch size"
                )
        given = self.per_device_train_batch_size
        self.per_device_train_batch_size = per_device_train_batch_size
        try:
            return fill_from_arguments(raw, self, self.world_size)
        finally:
            self.per_device_train_batch_size = given

    @contextlib.contextmanager
    def _deepspeed_hidden(self):
        given, self.deepspeed = self.deepspeed, None
        try:
            yield
        finally:
            self.deepspeed = given

    @cached_property
    def _setup_devices(self):
        # transformers reads `deepspeed` here too (to build a DeepSpeed process state). Launched
        # on a machine without a GPU, accelerate builds a real process group only when asked for
        # the CPU (process_state.py): ask for it while transformers builds the state, without
        # changing the user's `use_cpu`.
        given_use_cpu = self.use_cpu
        if launched_without_gpu():
            self.use_cpu = True
            self.ddp_backend = self.ddp_backend or "gloo"
        try:
            with self._deepspeed_hidden():
                return super()._setup_devices
        finally:
            self.use_cpu = given_use_cpu

    @property
    def deepspeed_cpp_enabled(self) -> bool:
        """Whether the Trainer trains with deepspeed_cpp's engine (a config was given)."""
        return self.deepspeed_cpp_config is not None


@dataclass
class TrainingArguments(_EngineArgumentsMixin, transformers.TrainingArguments):
    """``transformers.TrainingArguments`` whose ``deepspeed`` (a ds_config path or dict) selects
    deepspeed_cpp's engine; ``deepspeed_cpp_config`` is that config with the ``"auto"`` values
    the arguments decide filled in."""


@dataclass
class Seq2SeqTrainingArguments(_EngineArgumentsMixin, transformers.Seq2SeqTrainingArguments):
    """``transformers.Seq2SeqTrainingArguments`` taking ``deepspeed=`` as ``TrainingArguments``
    does."""
