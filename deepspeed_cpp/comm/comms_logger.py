"""The communication logger (DeepSpeed's ``comms_logger``): every collective deepspeed_cpp issues,
with its message size, latency and algorithmic / bus bandwidth, summed per op and size.

Off by default, and then free: nothing is wrapped (``collective_tap.py`` swaps torch's functions
only while it is on; the C++ reducer is wrapped only if it is on when the engine builds it).

Message size is DeepSpeed's: the collective's ``tensor`` argument, so the tensor of an all-reduce
or broadcast, the per-rank part an all-gather contributes (its input, 1/world_size of the
gathered output), the whole input of a reduce-scatter. The bandwidths are DeepSpeed's formulas
(``calc_bw_log``, in Gbps from the size in bytes and the latency in ms), which count an
all-gather's whole gathered buffer (size x world size); for a reduce-scatter, whose logged size
is already the whole input, DeepSpeed multiplies by the world size again and so overstates its
bandwidths world_size times: here they are taken from the whole input once.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from ..utils.logging import logger

_GATHER = {"all_gather", "all_gather_into_tensor"}  # size: one rank's part
_SCATTER = {"reduce_scatter", "reduce_scatter_tensor"}  # size: the whole input
_ALL_REDUCE = {"all_reduce", "all_reduce_coalesced", "inference_all_reduce"}
_POINT_TO_ALL = {"broadcast", "reduce", "gather", "scatter", "send", "recv", "barrier"}


def bandwidths(op: str, size: int, latency_ms: float, world_size: int) -> tuple[float, float]:
    """(algorithmic, bus) bandwidth in Gbps of ``size`` bytes moved by ``op`` in ``latency_ms``."""
    if latency_ms <= 0:
        return 0.0, 0.0
    n = world_size
    per_ms = size * (n if op in _GATHER else 1) / latency_ms
    if op == "all_to_all_single" or op in _GATHER or op in _SCATTER:
        algbw, busbw = per_ms, per_ms * (n - 1) / n
    elif op in _ALL_REDUCE:
        algbw, busbw = 2 * per_ms, per_ms * 2 * (n - 1) / n
    else:
        algbw = busbw = per_ms
    # bytes/ms -> Gbps
    return algbw * 8 / 1e6, busbw * 8 / 1e6


def convert_size(size_bytes: int) -> str:
    """DeepSpeed's size labels: ``0B``, ``512.0 B``, ``1.5 KB``, ``24.0 MB``."""
    if size_bytes == 0:
        return "0B"
    names = ("B", "KB", "MB", "GB", "TB", "PB", "EB", "ZB", "YB")
    index = int(math.floor(math.log(size_bytes, 1024)))
    return f"{round(size_bytes / math.pow(1024, index), 2)} {names[index]}"


def _trim_mean(values: list[float], proportion: float = 0.1) -> float:
    """The mean without the lowest and highest ``proportion`` (scipy's trim_mean, DeepSpeed's)."""
    ordered = sorted(values)
    cut = int(proportion * len(ordered))
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


@dataclass
class _Sizes:
    count: int = 0
    latencies: list[float] = field(default_factory=list)
    algbws: list[float] = field(default_factory=list)
    busbws: list[float] = field(default_factory=list)


class CommsLogger:
    """Records collectives; ``log_all`` prints DeepSpeed's summary table."""

    def __init__(self) -> None:
        self.enabled = False
        self.verbose = False
        self.prof_all = True
        self.prof_ops: list[str] = []
        self.debug = False
        self.comms_dict: dict[str, dict[int, _Sizes]] = defaultdict(dict)

    def configure(self, section) -> None:
        self.enabled = bool(section.enabled)
        self.verbose = bool(section.verbose)
        self.prof_all = bool(section.prof_all)
        self.prof_ops = list(section.prof_ops)
        self.debug = bool(section.debug)

    def wants(self, op: str) -> bool:
        return self.enabled and (self.prof_all or op in self.prof_ops)

    def append(self, op: str, record_name: str, latency_ms: float, size: int, world_size: int):
        algbw, busbw = bandwidths(op, size, latency_ms, world_size)
        sizes = self.comms_dict[record_name].setdefault(size, _Sizes())
        sizes.count += 1
        sizes.latencies.append(latency_ms)
        sizes.algbws.append(algbw)
        sizes.busbws.append(busbw)
        if self.verbose:
            logger.info(
                "comm op: %s | time (ms): %.2f | msg size: %s | algbw (Gbps): %.2f | "
                "busbw (Gbps): %.2f",
                record_name,
                latency_ms,
                convert_size(size),
                algbw,
                busbw,
            )

    def reset(self) -> None:
        self.comms_dict.clear()

    def summary(self) -> dict[str, dict[int, dict]]:
        """``{record: {size: {count, total_latency_ms, avg_latency_ms, algbw, busbw}}}``."""
        out = {}
        for record_name, by_size in self.comms_dict.items():
            out[record_name] = {
                size: {
                    "count": sizes.count,
                    "total_latency_ms": sum(sizes.latencies),
                    "avg_latency_ms": _trim_mean(sizes.latencies),
                    "algbw_gbps": _trim_mean(sizes.algbws),
                    "busbw_gbps": _trim_mean(sizes.busbws),
                }
                for size, sizes in sorted(by_size.items())
            }
        return out

    def log_all(self, print_log: bool = True) -> str:
        columns = (
            "Comm. Op",
            "Message Size",
            "Count",
            "Total Latency(ms)",
            "Avg Latency(ms)",
            "tput_avg (Gbps)",
            "busbw_avg (Gbps)",
        )
        lines = ["".join(f"{column: <20}" for column in columns)]
        for record_name, by_size in self.summary().items():
            lines.append(record_name)
            for size, row in by_size.items():
                lines.append(
                    f"{' ': <20}{convert_size(size): <20}{row['count']: <20}"
                    f"{row['total_latency_ms']: <20.2f}{row['avg_latency_ms']: <20.2f}"
                    f"{row['algbw_gbps']: <20.2f}{row['busbw_gbps']: <20.2f}"
                )
        table = "\n".join(lines)
        if print_log:
            print(table, flush=True)
        return table


comms_logger = CommsLogger()
"""The process's one logger, as DeepSpeed's ``deepspeed.comm.comms_logger``."""
