"""A clear refusal when accelerate's own DeepSpeed integration tries to drive our engine.

With the ``import deepspeed`` alias active, an unmodified Hugging Face script
(``from transformers import Trainer``, ``--deepspeed ds_config.json``) takes transformers'
DeepSpeed path: accelerate sets its process state to ``DistributedType.DEEPSPEED`` and its
``Accelerator._prepare_deepspeed`` calls ``deepspeed.initialize``. That path cannot be mapped
thinly and honestly onto deepspeed_cpp:

- on a machine without a GPU, accelerate 1.15 gives that state no backend, so every rank counts a
  world of one: the data is not sharded and ``train_batch_size`` is computed for one rank (the
  engine would fail on the batch rule; real DeepSpeed fails the same way here);
- accelerate's wrappers and transformers' Trainer then reach into DeepSpeed internals
  (``optimizer.overflow``, ``_zero3_consolidated_16bit_state_dict``, its checkpoint
  loading rules) that our engine does not imitate.

``deepspeed_cpp.hf`` does this job with an accelerate subclass of its own, so the refusal names it.
"""

from __future__ import annotations

import sys

USE_OUR_TRAINER = (
    "change `from transformers import Trainer, TrainingArguments` to "
    "`from deepspeed_cpp.hf import Trainer, TrainingArguments` (also Seq2SeqTrainer, "
    "Seq2SeqTrainingArguments); with accelerate directly, use deepspeed_cpp.hf.EngineAccelerator"
)


def accelerate_deepspeed_mode_active() -> bool:
    """Whether accelerate, already imported, has set this process up for its DeepSpeed mode."""
    state_module = sys.modules.get("accelerate.state")
    if state_module is None:
        return False
    distributed_type = state_module.PartialState._shared_state.get("distributed_type")
    return getattr(distributed_type, "value", distributed_type) == "DEEPSPEED"


def refuse_accelerate_deepspeed_driver() -> None:
    """Raises when accelerate's DeepSpeed integration is the caller (see the module docstring)."""
    if accelerate_deepspeed_mode_active():
        raise RuntimeError(
            "deepspeed_cpp.initialize was called by accelerate's DeepSpeed integration "
            "(transformers' Trainer with --deepspeed/deepspeed=..., here answered by the "
            "'import deepspeed' alias): that path needs DeepSpeed itself and cannot train on "
            f"deepspeed_cpp's engine. To train on deepspeed_cpp, {USE_OUR_TRAINER}"
        )
