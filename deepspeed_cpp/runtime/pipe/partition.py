"""How a pipeline's layers are split into stages: contiguous ranges, as DeepSpeed splits them
(the same bounds for the same input, so checkpoints' ``layer_XX`` files land on the same stage)."""

from __future__ import annotations


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Bounds (``num_parts + 1`` offsets) of near-equal ranges; the first ranges take the
    remainder."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    bounds = [0]
    for part in range(num_parts):
        bounds.append(bounds[-1] + size + (1 if part < extra else 0))
    return bounds


def partition_balanced(weights: list[float], num_parts: int) -> list[int]:
    """Bounds of contiguous ranges whose weight sums are as even as possible: the split that
    minimises (heaviest part − lightest part), by dynamic programming over (items, parts). Ties
    go to the latest split point, as DeepSpeed's do, so both give the same bounds."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    inf = float("inf")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    # best[i][j] = (cost, heaviest, lightest) of splitting the first i items into j parts.
    best_max = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    best_min = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    best_cost = [[inf] * (num_parts + 1) for _ in range(n + 1)]
    split = [[0] * (num_parts + 1) for _ in range(n + 1)]
    best_max[0][0] = 0.0
    best_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, num_parts) + 1):
            for k in range(i):
                part = prefix[i] - prefix[k]
                heaviest = max(best_max[k][j - 1], part)
                lightest = min(best_min[k][j - 1], part)
                cost = heaviest - lightest
                if best_cost[i][j] >= cost:
                    best_cost[i][j], best_max[i][j], best_min[i][j] = cost, heaviest, lightest
                    split[i][j] = k
    bounds = [n]
    for j in range(num_parts, 0, -1):
        bounds.append(split[bounds[-1]][j])
    return bounds[::-1]
