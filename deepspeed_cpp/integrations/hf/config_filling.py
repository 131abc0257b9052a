"""Filling a ds_config's ``"auto"`` values from Hugging Face ``TrainingArguments``.

The rules are those of the Hugging Face DeepSpeed guide, in two stages because the values come
at two times:

* from the training arguments alone (when ``TrainingArguments`` is built): batch sizes, gradient
  accumulation, clipping, the optimizer's hyper-parameters, the scheduler's peak and floor, and
  fp16/bf16;
* from the model and the number of optimizer steps (when the Trainer starts training): the ZeRO
  bucket sizes from the model's hidden size and the scheduler's ``total_num_steps`` and
  ``warmup_num_steps``.

A key holding ``"auto"`` takes the argument's value. A key holding a value is left alone, but
where the guide says the two must agree, a different value is a mismatch: every mismatch of a
stage is reported in one error, so a user fixes the config in one go.

This module works on plain dicts (no transformers import), so its rules are unit-testable.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

AUTO = "auto"

# Keys that size the data path: the Trainer's data loader already fixes them, so a config that
# leaves them out takes the Trainer's numbers (DeepSpeed proper would refuse the config instead).
_BATCH_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")


class ConfigMismatchError(ValueError):
    """ds_config values that disagree with the TrainingArguments; ``mismatches`` lists them."""

    def __init__(self, mismatches: list[str]):
        self.mismatches = list(mismatches)
        listed = "\n".join(f"- {line}" for line in self.mismatches)
        super().__init__(
            "the DeepSpeed config disagrees with the TrainingArguments on these keys:\n"
            f"{listed}\n"
            'Change the config value or the argument so they agree; "auto" in the config takes '
            "the argument's value."
        )

    def __reduce__(self):
        # Rebuilt from its lines (pickled between processes), not from the whole message.
        return type(self), (self.mismatches,)


@dataclass
class _Filler:
    """One fill pass over a config dict: fills ``"auto"`` and records disagreements."""

    config: dict
    mismatches: list[str] = field(default_factory=list)

    def _node(self, path: str) -> tuple[dict | None, str]:
        *parents, key = path.split(".")
        node = self.config
        for parent in parents:
            child = node.get(parent)
            if not isinstance(child, dict):
                return None, key
            node = child
        return node, key

    def fill(self, path: str, value: Any, argument: str, must_match: bool = True) -> None:
        """``"auto"`` at ``path`` becomes ``value``; a different explicit value is a mismatch
        when ``must_match``. A missing key (or section) is left missing."""
        node, key = self._node(path)
        if node is None or key not in node:
            return
        current = node[key]
        if current == AUTO:
            node[key] = value
        elif must_match and current is not None and not _same(current, value):
            self.mismatches.append(
                f"'{path}' = {current!r} in the config, but {argument} = {value!r}"
            )

    def fill_missing_too(self, path: str, value: Any, argument: str) -> None:
        """As ``fill``, and a top-level key that is absent is added with ``value``."""
        if path not in self.config:
            self.config[path] = value
        else:
            self.fill(path, value, argument)

    def is_auto(self, path: str) -> bool:
        node, key = self._node(path)
        return node is not None and node.get(key) == AUTO

    def raise_mismatches(self) -> None:
        if self.mismatches:
            raise ConfigMismatchError(self.mismatches)


def _same(config_value: Any, argument_value: Any) -> bool:
    # JSON has lists where the arguments have tuples; numbers compare by value (1 == 1.0).
    if isinstance(config_value, (list, tuple)) and isinstance(argument_value, (list, tuple)):
        return len(config_value) == len(argument_value) and all(
            _same(a, b) for a, b in zip(config_value, argument_value)
        )
    return config_value == argument_value


def fill_from_arguments(config: dict, args: Any, world_size: int) -> dict:
    """A copy of ``config`` with the argument-only ``"auto"`` values filled from ``args`` (a
    ``transformers.TrainingArguments``) for ``world_size`` data-parallel ranks (every rank
    under AutoTP, as DeepSpeed and transformers count them). Raises ConfigMismatchError naming
    every key set to a value that disagrees with its argument."""
    filler = _Filler(copy.deepcopy(config))
    micro = args.per_device_train_batch_size
    accumulation = args.gradient_accumulation_steps
    # DeepSpeed's identity: train_batch_size = micro batch x accumulation x data-parallel ranks.
    filler.fill_missing_too("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    filler.fill_missing_too(
        "gradient_accumulation_steps", accumulation, "gradient_accumulation_steps"
    )
    filler.fill_missing_too(
        "train_batch_size",
        world_size * micro * accumulation,
        f"world_size x per_device_train_batch_size x gradient_accumulation_steps "
        f"({world_size} x {micro} x {accumulation})",
    )
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill(
        "optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "[adam_beta1, adam_beta2]"
    )
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    # The warm-up floor is no training argument: "auto" means 0 and any value stands.
    filler.fill("scheduler.params.warmup_min_lr", 0, "(none)", must_match=False)
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    filler.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16 or fp16_full_eval")
    filler.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16 or bf16_full_eval")
    filler.raise_mismatches()
    return filler.config


def model_hidden_size(model: Any) -> int | None:
    """The hidden size the guide sizes ZeRO buckets by: ``config.hidden_size``, else the largest
    of ``config.hidden_sizes``, else the same from ``config.text_config``; None if none."""
    model_config = getattr(model, "config", None)
    for candidate in (model_config, getattr(model_config, "text_config", None)):
        if candidate is None:
            continue
        size = getattr(candidate, "hidden_size", None)
        if isinstance(size, int):
            return size
        sizes = getattr(candidate, "hidden_sizes", None)
        if sizes:
            return max(sizes)
    return None


def fill_from_model_and_steps(
    config: dict, model: Any, num_training_steps: int, warmup_steps: int
) -> dict:
    """A copy of ``config`` (already through ``fill_from_arguments``) with the ZeRO bucket sizes
    filled from the model's hidden size and the scheduler's step counts. Raises
    ConfigMismatchError naming every step count set to a value that disagrees."""
    filler = _Filler(copy.deepcopy(config))
    by_hidden_size = {
        "zero_optimization.reduce_bucket_size": lambda h: h * h,
        "zero_optimization.stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
        "zero_optimization.stage3_param_persistence_threshold": lambda h: 10 * h,
    }
    wanted = [path for path in by_hidden_size if filler.is_auto(path)]
    if wanted:
        hidden = model_hidden_size(model)
        if hidden is None:
            raise ValueError(
                f'{", ".join(repr(p) for p in wanted)} = "auto" are sized from the model\'s '
                "hidden size, but the model's config has no hidden_size or hidden_sizes: "
                "expected an integer value in the config for each"
            )
        for path in wanted:
            filler.fill(path, by_hidden_size[path](hidden), "(from the hidden size)")
    filler.fill(
        "scheduler.params.total_num_steps", num_training_steps, "the Trainer's optimizer steps"
    )
    # Our warm-up schedules, like DeepSpeed's recent ones, need at least one warm-up step.
    filler.fill(
        "scheduler.params.warmup_num_steps",
        max(1, warmup_steps),
        "warmup_steps (from warmup_steps/warmup_ratio)",
    )
    filler.raise_mismatches()
    return filler.config


def unresolved_auto_keys(config: dict, prefix: str = "") -> list[str]:
    """Dotted paths still holding ``"auto"``."""
    found = []
    for key, value in config.items():
        path = f"{prefix}{key}"
        if value == AUTO:
            found.append(path)
        elif isinstance(value, dict):
            found += unresolved_auto_keys(value, path + ".")
    return found
