"""DeepSpeedConfigError, and how a problem in the config is put into words.

Every problem names the key path (``zero_optimization.stage``), the value found there, and what
was expected instead. Problems are collected and raised together, so one run shows them all.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from pydantic import ValidationError


class DeepSpeedConfigError(ValueError):
    """The DeepSpeed config is invalid, or asks for something deepspeed_cpp cannot do yet.

    ``problems`` holds one sentence per problem; ``str()`` lists them all.
    """

    def __init__(self, problems: Iterable[str], source: str | None = None):
        self.problems = tuple(problems)
        self.source = source
        where = f" ({source})" if source else ""
        if len(self.problems) == 1:
            message = f"Invalid DeepSpeed config{where}: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {problem}" for problem in self.problems)
            message = f"Invalid DeepSpeed config{where}, {len(self.problems)} problems:\n{lines}"
        super().__init__(message)

    def __reduce__(self):
        # Rebuilt from its problems, not from the message: an error raised in a worker process
        # (multiprocessing, torch.multiprocessing) arrives whole, not as one problem per letter.
        return type(self), (self.problems, self.source)


class BatchSizeError(DeepSpeedConfigError, AssertionError):
    """Batch sizes that contradict each other or leave one underivable, from
    ``DeepSpeedConfig._configure_train_batch_size``: DeepSpeed asserts there, so scripts (and its
    tests) catch AssertionError."""


class GradAccumDtypeNotImplementedError(DeepSpeedConfigError, NotImplementedError):
    """A config DeepSpeed refuses with NotImplementedError too: a ``data_types.grad_accum_dtype``
    other than the model's dtype without ZeRO (``grad_accum_dtype.py``)."""


def show(value: Any, limit: int = 80) -> str:
    """A value as the user wrote it in JSON (true, null, "text"), shortened if long."""
    try:
        shown = json.dumps(value)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def join_path(parts: Iterable[Any]) -> str:
    return ".".join(str(part) for part in parts)


def describe_validation_error(
    error: ValidationError,
    prefix: tuple[str, ...],
    unknown_key: Callable[[tuple[str, ...], Any], str],
    missing_context: str = "",
) -> list[str]:
    """One problem sentence per pydantic error, located under ``prefix``.

    ``unknown_key(path, value)`` words an unknown key (it knows the valid names and suggests
    the nearest one); ``missing_context`` completes "X is required" (e.g. "by WarmupDecayLR").
    """
    problems = []
    for item in error.errors():
        loc = prefix + tuple(str(part) for part in item["loc"])
        path = join_path(loc)
        value = item.get("input")
        kind = item["type"]
        if kind == "extra_forbidden":
            problems.append(unknown_key(loc, value))
        elif kind == "missing":
            problems.append(f"{path} is required{missing_context}")
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            problems.append(f"{path} = {show(value)}: expected a JSON object {{...}}")
        elif kind == "ds_config_value":
            problems.append(f"{path} = {show(value)}: {item['msg']}")
        else:  # raised inside a validator: the message already says what was expected
            message = item["msg"].removeprefix("Value error, ")
            problems.append(f"{path} = {show(value)}: {message}")
    return problems
