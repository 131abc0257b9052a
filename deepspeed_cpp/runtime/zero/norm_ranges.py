"""The gradient norm of a ZeRO stage under model parallelism: which parts of a rank's owned
gradient slice it adds to the whole model's norm (a parameter every model-parallel rank holds
whole counts on one of them only: ``runtime/model_parallel.py``'s ``counts_in_norm``)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def counted_ranges(
    buckets: list, counts: Callable[[torch.nn.Parameter], bool] | None
) -> list[list[tuple[int, int]] | None] | None:
    """Per bucket (a ZeRO stage's ``_Bucket``), the ``(start, stop)`` ranges of this rank's
    owned slice whose parameters count in the gradient norm (None: the whole slice); None when
    every parameter counts."""
    if counts is None or all(counts(p) for bucket in buckets for p in bucket.params):
        return None
    result: list[list[tuple[int, int]] | None] = []
    for bucket in buckets:
        if all(counts(p) for p in bucket.params):
            result.append(None)
            continue
        low, high = bucket.owned_start, bucket.owned_start + bucket.owned_size
        ranges = []
        for param, offset in zip(bucket.params, bucket.offsets):
            start, stop = max(offset, low), min(offset + param.numel(), high)
            if counts(param) and start < stop:
                ranges.append((start - low, stop - low))
        result.append(ranges)
    return result


def norm_of_ranges(grad: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """The float32 norm of ``grad`` over ``ranges`` (zero when there are none)."""
    if not ranges:
        return grad.new_zeros(())
    parts = torch._foreach_norm([grad[start:stop] for start, stop in ranges])
    return torch.stack(parts).double().pow(2).sum().sqrt().float()
