"""Leaf value types of the ds_config schema, and the base class of its sections.

JSON gives few types, and DeepSpeed configs rely on two leniencies that we keep: integers
written as whole-number floats (``"reduce_bucket_size": 5e8``) and the string ``"auto"`` in any
leaf, which the Hugging Face integration fills in later. Everything else is strict: ``true`` is
not an integer, ``"2"`` is not a stage, ``1`` is not a boolean. Each type rejects bad input with
a message saying what was expected; ``errors.py`` adds the key path and the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainValidator
from pydantic_core import PydanticCustomError

AUTO = "auto"


def is_auto(value: Any) -> bool:
    """True for the placeholder ``"auto"`` that the Hugging Face integration fills."""
    return isinstance(value, str) and value == AUTO


class ConfigSection(BaseModel):
    """A JSON object of the config: unknown keys are errors, DeepSpeed's aliases are accepted.

    DeepSpeed's sections accept a field under its Python name as well as under its JSON alias
    (``prefetch_bucket_size`` and ``stage3_prefetch_bucket_size``), so ours do too.
    """

    model_config = ConfigDict(extra="forbid", validate_by_name=True, validate_by_alias=True)


def _reject(expected: str):
    raise PydanticCustomError("ds_config_value", "expected {expected}", {"expected": expected})


def _range_text(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def _or_null(expected: str, optional: bool) -> str:
    return f"{expected}, or null" if optional else expected


def _leaf(check: Callable[[Any], Any], optional: bool) -> PlainValidator:
    """Wraps ``check`` so that "auto" passes through and None is accepted when optional."""

    def validate(value: Any) -> Any:
        if is_auto(value):
            return AUTO
        if value is None and optional:
            return None
        return check(value)

    return PlainValidator(validate)


def integer(minimum: int | None = None, maximum: int | None = None, *, optional: bool = False):
    """An integer field; whole-number floats (5e8) are accepted, booleans are not."""
    expected = _or_null("an integer" + _range_text(minimum, maximum), optional)

    def check(value: Any) -> int:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            _reject(expected)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            _reject(expected)
        return value

    return Annotated[int, _leaf(check, optional)]


def print_interval():
    """A step interval (an integer >= 1) or positive infinity, read as "never" and stored as 0.

    accelerate's DeepSpeed plugin sets ``steps_per_print = float("inf")`` to silence DeepSpeed's
    progress line, which DeepSpeed accepts; JSON cannot spell it, Python dicts can."""
    expected = "an integer >= 1 or infinity (never)"

    def check(value: Any) -> int:
        if isinstance(value, float) and value == math.inf:
            return 0
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            _reject(expected)
        return value

    return Annotated[int, _leaf(check, optional=False)]


def _as_number(value: Any, expected: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        _reject(expected)
    return float(value)


def number(minimum: float | None = None, maximum: float | None = None, *, optional: bool = False):
    """A finite real-number field (integers accepted); the range bounds are inclusive."""
    expected = _or_null("a number" + _range_text(minimum, maximum), optional)

    def check(value: Any) -> float:
        value = _as_number(value, expected)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            _reject(expected)
        return value

    return Annotated[float, _leaf(check, optional)]


def number_or_list(
    minimum: float | None = None, maximum: float | None = None, *, optional: bool = False
):
    """One number, or one number per optimizer param group (DeepSpeed's schedules take both)."""
    bounds = _range_text(minimum, maximum)
    expected = _or_null(f"a number{bounds} or a non-empty list of such numbers", optional)

    def check_one(value: Any) -> float:
        value = _as_number(value, expected)
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            _reject(expected)
        return value

    def check(value: Any) -> float | list[float]:
        if isinstance(value, (list, tuple)):
            if not value:
                _reject(expected)
            return [check_one(item) for item in value]
        return check_one(value)

    return Annotated[float | list[float], _leaf(check, optional)]


def boolean(*, optional: bool = False):
    """A JSON ``true``/``false``; numbers and strings are rejected rather than guessed at."""
    expected = _or_null("true or false", optional)

    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            _reject(expected)
        return value

    return Annotated[bool, _leaf(check, optional)]


def choice(choices: Iterable[str], *, case_sensitive: bool = True, optional: bool = False):
    """One of a fixed set of strings; returns the canonical spelling from ``choices``."""
    choices = tuple(choices)
    expected = _or_null("one of " + ", ".join(repr(c) for c in choices), optional)
    canonical = {(c if case_sensitive else c.lower()): c for c in choices}

    def check(value: Any) -> str:
        if not isinstance(value, str):
            _reject(expected)
        key = value if case_sensitive else value.lower()
        if key not in canonical:
            _reject(expected)
        return canonical[key]

    return Annotated[str, _leaf(check, optional)]


def text(*, optional: bool = False):
    """Any string (paths, names)."""
    expected = _or_null("a string", optional)

    def check(value: Any) -> str:
        if not isinstance(value, str):
            _reject(expected)
        return value

    return Annotated[str, _leaf(check, optional)]


def string_list():
    """A list of strings, or one string standing for a list of one (DeepSpeed coerces it so);
    repeated entries are dropped, the first kept. Not "auto"-aware: "auto" is one string here."""
    expected = "a string or a list of strings"

    def check(value: Any) -> list[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            _reject(expected)
        return list(dict.fromkeys(value))

    return Annotated[list[str], PlainValidator(check)]


def adam_betas():
    """Adam's (beta1, beta2): two numbers in [0, 1)."""
    expected = "a list of two numbers, each in [0, 1)"

    def check(value: Any) -> tuple[float, float]:
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            _reject(expected)
        betas = tuple(_as_number(item, expected) for item in value)
        if not all(0.0 <= beta < 1.0 for beta in betas):
            _reject(expected)
        return betas

    return Annotated[tuple[float, float], _leaf(check, False)]
