"""DeepSpeed's ``partition_uniform`` / ``partition_balanced`` / ``prefix_sum_inc``
(``deepspeed.runtime.utils``): split a sequence of layers into contiguous parts, as pipeline
stages are cut. A result ``parts`` has ``num_parts + 1`` boundaries: part ``i`` is
``items[parts[i]:parts[i + 1]]``."""

from __future__ import annotations


def prefix_sum_inc(weights) -> list:
    """Inclusive prefix sums: ``[3, 4, 5] -> [3, 7, 12]``."""
    sums, total = [], 0
    for weight in weights:
        total = total + weight
        sums.append(total)
    return sums


def _check_parts(num_parts) -> None:
    if not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_parts={num_parts!r} must be a positive integer")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` parts of ``num_items`` items as equal as possible, the first
    ``num_items % num_parts`` parts one item larger; with fewer items than parts, one item per
    part and empty parts at the end."""
    _check_parts(num_parts)
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights, num_parts: int) -> list[int]:
    """Boundaries of ``num_parts`` non-empty contiguous parts of ``weights`` with even sums, cut
    as DeepSpeed cuts them: dynamic programming over (items so far, parts so far) that keeps,
    for each, the one split of least spread (largest part sum - smallest), ties to the latest
    last cut, and extends it. Keeping one split per prefix can miss the most even split of all
    (by a fraction of the largest weight); DeepSpeed's pipeline stages are cut this way, and so
    are ours. With no more items than parts: ``partition_uniform``."""
    _check_parts(num_parts)
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    prefix = [0.0, *(float(s) for s in prefix_sum_inc(weights))]
    inf = float("inf")
    # best[i][j]: (cost, largest, smallest, cut) of the first i items in j parts
    best = [[(inf, inf, inf, 0)] * (num_parts + 1) for _ in range(n + 1)]
    best[0][0] = (0.0, 0.0, inf, 0)
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for cut in range(i):
                _, largest, smallest, _ = best[cut][j - 1]
                part = prefix[i] - prefix[cut]
                high, low = max(largest, part), min(smallest, part)
                if best[i][j][0] >= high - low:
                    best[i][j] = (high - low, high, low, cut)
    parts = [n]
    for j in range(num_parts, 0, -1):
        parts.append(best[parts[-1]][j][3])
    return parts[::-1]
