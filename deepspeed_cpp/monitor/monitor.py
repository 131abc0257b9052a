"""Monitor (the back-end interface) and MonitorMaster (every enabled back-end as one)."""

from __future__ import annotations

import os
from collections.abc import Iterable

Event = tuple  # (name: str, value: float, step: int), TensorBoard's add_scalar arguments


class Monitor:
    """A back-end: ``write_events`` records each ``(name, value, step)``."""

    def __init__(self, section) -> None:
        self.enabled = bool(section.enabled)

    def write_events(self, event_list: Iterable[Event]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Flushes and closes what the back-end holds open."""


def run_folder(output_path: str | None, job_name: str, default_base: str) -> str:
    """``output_path/job_name``, or DeepSpeed's default ``~/<default_base>/job_name``."""
    base = output_path or os.path.join(os.path.expanduser("~"), default_base)
    return os.path.join(base, job_name)


class MonitorMaster(Monitor):
    """Every back-end the config enables, written as one; DeepSpeed's ``MonitorMaster``.

    ``config`` is a DeepSpeedConfig (or anything with its ``tensorboard``, ``csv_monitor``,
    ``wandb`` and ``comet`` sections). Only ``rank`` 0 builds back-ends and writes; every rank
    checks that the enabled back-ends' packages are installed, so a missing one fails
    everywhere alike.
    """

    def __init__(self, config, rank: int | None = None) -> None:
        self.enabled = any(
            getattr(config, name).enabled
            for name in ("tensorboard", "csv_monitor", "wandb", "comet")
        )
        self.monitors: list[Monitor] = []
        if not self.enabled:
            return
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_initialized() else 0
        from .comet import CometMonitor
        from .csv_monitor import csvMonitor
        from .tensorboard import TensorBoardMonitor
        from .wandb import WandbMonitor

        kinds = (
            (config.tensorboard, TensorBoardMonitor),
            (config.wandb, WandbMonitor),
            (config.csv_monitor, csvMonitor),
            (config.comet, CometMonitor),
        )
        for section, kind in kinds:
            if section.enabled:
                kind.check_installed()
        if rank == 0:
            self.monitors = [kind(section) for section, kind in kinds if section.enabled]

    def write_events(self, event_list: Iterable[Event]) -> None:
        events = list(event_list)
        for monitor in self.monitors:
            monitor.write_events(events)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
