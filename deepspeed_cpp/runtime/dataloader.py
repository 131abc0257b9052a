"""The data loader ``initialize(training_data=...)`` returns: one DistributedSampler per rank."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

from ..utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader", "make_distributed_loader"]


def make_distributed_loader(
    dataset, *, batch_size: int, rank: int, world_size: int, collate_fn=None, drop_last=False
) -> DataLoader:
    """Each rank reads its own 1/world_size of ``dataset``, ``batch_size`` samples at a time.

    The sampler shuffles with a seed shared by all ranks; call ``loader.sampler.set_epoch(e)``
    at each epoch for a new order, as with any DistributedSampler.
    """
    if not isinstance(dataset, torch.utils.data.Dataset):
        raise TypeError(
            f"training_data must be a torch.utils.data.Dataset, got {type(dataset).__name__}"
        )
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        drop_last=drop_last,
    )
