"""``deepspeed.utils.RepeatingLoader``: iterate a data loader forever."""

from __future__ import annotations


class RepeatingLoader:
    """Wraps an iterable (a ``DataLoader``); at its end, starts it again instead of stopping, so
    a training loop can ``next()`` it for any number of steps. A re-started ``DataLoader`` whose
    sampler is a ``DistributedSampler`` repeats the same order unless the caller calls
    ``set_epoch`` on it."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            # An empty loader raises StopIteration again here: there is nothing to repeat.
            return next(self.data_iter)
