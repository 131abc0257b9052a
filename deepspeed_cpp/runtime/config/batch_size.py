"""DeepSpeed's batch-size rule, with the third value derived from the other two.

    train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * world_size

Any two given: the third is derived. Only ``train_batch_size`` or only the micro batch given:
``gradient_accumulation_steps`` is 1 and the other is derived (DeepSpeed's behaviour). Neither
of those two given: an error. Where DeepSpeed floors a division that does not come out even
(and then fails a consistency check), the error here says which division and why.
"""

from __future__ import annotations

from typing import NamedTuple

TRAIN = "train_batch_size"
MICRO = "train_micro_batch_size_per_gpu"
ACCUMULATION = "gradient_accumulation_steps"


class BatchSizes(NamedTuple):
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int


def _divide_train(train: int, denominator: int, denominator_text: str, derived: str) -> int:
    if train % denominator != 0:
        raise ValueError(
            f"{TRAIN} = {train} is not divisible by {denominator_text} = {denominator}, so "
            f"{derived} cannot be derived: expected {TRAIN} to be a multiple of {denominator}"
        )
    return train // denominator


def resolve_batch_sizes(
    train: int | None, micro: int | None, accumulation: int | None, world_size: int
) -> BatchSizes:
    """The three batch numbers for ``world_size`` ranks; ValueError saying what is wrong."""
    given = {
        name: value
        for name, value in ((TRAIN, train), (MICRO, micro), (ACCUMULATION, accumulation))
        if value is not None
    }
    if len(given) == 3:
        product = micro * accumulation * world_size
        if train != product:
            raise ValueError(
                f"the batch sizes contradict each other: {TRAIN} ({train}) must equal {MICRO} "
                f"({micro}) * {ACCUMULATION} ({accumulation}) * world_size ({world_size}) = "
                f"{product}; expected consistent values, or give only two of the three and let "
                "the third be derived"
            )
    elif train is not None and micro is not None:
        text = f"{MICRO} ({micro}) * world_size ({world_size})"
        accumulation = _divide_train(train, micro * world_size, text, ACCUMULATION)
    elif train is not None and accumulation is not None:
        text = f"{ACCUMULATION} ({accumulation}) * world_size ({world_size})"
        micro = _divide_train(train, accumulation * world_size, text, MICRO)
    elif micro is not None and accumulation is not None:
        train = micro * accumulation * world_size
    elif train is not None:
        accumulation = 1
        micro = _divide_train(train, world_size, "world_size", MICRO)
    elif micro is not None:
        accumulation = 1
        train = micro * world_size
    else:
        alone = f" ({ACCUMULATION} = {accumulation} alone cannot set them)" if given else ""
        raise ValueError(
            f"{TRAIN} and {MICRO} are both missing{alone}: expected at least one of them "
            f"({TRAIN} = {MICRO} * {ACCUMULATION} * world_size)"
        )
    return BatchSizes(train, micro, accumulation)
