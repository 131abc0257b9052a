"""``"auto"`` values: where they are, filling them in, and the error for those left over.

The Hugging Face Trainer integration ships configs with ``"auto"`` in keys it fills from its
own training arguments before DeepSpeed reads the config. A config may hold them until it is
finalised for the engine; then every ``"auto"`` must have become a value.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from .values import is_auto

# The keys that transformers' HfTrainerDeepSpeedConfig fills from TrainingArguments and the model.
HF_TRAINER_FILLS = frozenset(
    {
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
        "train_batch_size",
        "gradient_clipping",
        "optimizer.params.lr",
        "optimizer.params.betas",
        "optimizer.params.eps",
        "optimizer.params.weight_decay",
        "scheduler.params.warmup_min_lr",
        "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps",
        "scheduler.params.total_num_steps",
        "fp16.enabled",
        "bf16.enabled",
        "amp.enabled",
        "amp.opt_level",
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    }
)


# Keys for which "auto" is a value of DeepSpeed's own (its default), not a placeholder for the
# Hugging Face integration to fill: "take the PipelineModule's number of stages".
AUTO_AS_VALUE = frozenset({"pipeline.stages"})


def find_auto_paths(data: Any, skip: Collection[str] = (), prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value inside the objects of ``data``, except under the
    paths in ``skip`` (sections that are ignored, where an "auto" changes nothing)."""
    paths = []
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}{key}"
            if path in skip:
                continue
            if is_auto(value):
                paths.append(path)
            else:
                paths.extend(find_auto_paths(value, skip, path + "."))
    return paths


def fill_auto_values(data: dict, values: Mapping[str, Any]) -> list[str]:
    """Writes ``values`` (dotted path -> value) where ``data`` holds ``"auto"``; in place.

    Keys whose value is not ``"auto"`` are left as the user wrote them, as the Hugging Face
    integration does. Returns the paths that were filled.
    """
    filled = []
    for path, value in values.items():
        node = data
        *parents, key = path.split(".")
        for parent in parents:
            node = node.get(parent) if isinstance(node, dict) else None
        if isinstance(node, dict) and is_auto(node.get(key)):
            node[key] = value
            filled.append(path)
    return filled


def unresolved_auto_problem(paths: list[str]) -> str:
    """The error for ``"auto"`` values still present when the config is finalised."""
    listed = ", ".join(f"'{path}'" for path in paths)
    problem = (
        f'{listed} still "auto": expected a value. The Hugging Face Trainer integration '
        "(TrainingArguments(deepspeed=...)) fills these keys from its training arguments; "
        "without it, set each value in the config, or call config.fill_auto({path: value, ...}) "
        "before finalize()"
    )
    not_by_hf = [path for path in paths if path not in HF_TRAINER_FILLS]
    if not_by_hf:
        listed = ", ".join(f"'{path}'" for path in not_by_hf)
        problem += f"; the Hugging Face integration does not fill {listed}: set them yourself"
    return problem
