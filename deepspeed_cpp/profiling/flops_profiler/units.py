"""DeepSpeed's number formats for profiles: ``62.01 K``, ``654.34 KMACs``, ``1.06 GFLOPS``."""

from __future__ import annotations

_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    if units is None:
        for scale, prefix in _PREFIXES:
            if abs(num) >= scale:
                return f"{round(num / scale, precision)} {prefix}"
        return f"{round(num, precision)} "
    scale = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0}[units]
    return f"{round(num / scale, precision)} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return f"{number_to_string(flops, units, precision)}FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(params, units, precision).rstrip()


def duration_to_string(seconds: float, precision: int = 2) -> str:
    if seconds >= 1:
        return f"{round(seconds, precision)} s"
    if seconds >= 1e-3:
        return f"{round(seconds * 1e3, precision)} ms"
    return f"{round(seconds * 1e6, precision)} us"
