"""DeepSpeed's ``runtime.config.get_*(param_dict)`` readers: one value from a raw ``ds_config``
dict, with DeepSpeed's default when the key is absent. For code that reads a config without
building an engine; the engine itself reads the validated ``DeepSpeedConfig``."""

from __future__ import annotations

from ..constants import GRADIENT_CLIPPING_DEFAULT

ADAM_OPTIMIZER = "adam"
ADAMW_OPTIMIZER = "adamw"
LAMB_OPTIMIZER = "lamb"
ADAGRAD_OPTIMIZER = "adagrad"
LION_OPTIMIZER = "lion"


def get_gradient_clipping(param_dict: dict) -> float:
    return param_dict.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT)


def get_gradient_accumulation_steps(param_dict: dict):
    return param_dict.get("gradient_accumulation_steps")


def get_train_batch_size(param_dict: dict):
    return param_dict.get("train_batch_size")


def get_train_micro_batch_size_per_gpu(param_dict: dict):
    return param_dict.get("train_micro_batch_size_per_gpu")


def get_steps_per_print(param_dict: dict) -> int:
    return param_dict.get("steps_per_print", 10)


def get_optimizer_name(param_dict: dict) -> str | None:
    optimizer = param_dict.get("optimizer")
    return optimizer.get("type") if optimizer else None


def get_optimizer_params(param_dict: dict) -> dict | None:
    optimizer = param_dict.get("optimizer")
    return optimizer.get("params") if optimizer and get_optimizer_name(param_dict) else None


def get_scheduler_name(param_dict: dict) -> str | None:
    scheduler = param_dict.get("scheduler")
    return scheduler.get("type") if scheduler else None


def get_scheduler_params(param_dict: dict) -> dict | None:
    scheduler = param_dict.get("scheduler")
    return scheduler.get("params") if scheduler and get_scheduler_name(param_dict) else None
