"""DeepSpeed's ``deepspeed.utils.numa.parse_range_list``: core lists such as ``"0,2-4,6"``."""

from __future__ import annotations


def _parse_range(text: str, whole: str) -> range:
    if text.lstrip("-").isdigit() and not text.startswith("-"):
        value = int(text)
        return range(value, value + 1)
    parts = text.split("-")
    if len(parts) != 2 or not all(part.isdigit() for part in parts):
        raise ValueError(
            f"bad range {text!r} in {whole!r}: expected a number or two numbers joined by '-'"
        )
    start, end = int(parts[0]), int(parts[1])
    if start > end:
        raise ValueError(f"bad range {text!r} in {whole!r}: its end must be >= its start")
    return range(start, end + 1)


def parse_range_list(range_str: str) -> list[int]:
    """``"0,2-4,6"`` -> ``[0, 2, 3, 4, 6]``: comma-separated numbers or inclusive ranges, in
    ascending order without overlap (ValueError naming the range otherwise)."""
    numbers: list[int] = []
    for part in range_str.split(","):
        sub = _parse_range(part, range_str)
        if numbers and sub[0] <= numbers[-1]:
            raise ValueError(
                f"bad range list {range_str!r}: sub-ranges must ascend and not overlap "
                f"({part!r} starts at or below {numbers[-1]})"
            )
        numbers.extend(sub)
    return numbers
