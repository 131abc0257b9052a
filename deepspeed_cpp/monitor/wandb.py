"""wandb: Weights & Biases; ``WANDB_MODE=offline`` writes the run under ``./wandb`` with no
account. DeepSpeed's keys: ``project``, ``group``, ``team`` (the entity)."""

from __future__ import annotations

from .missing_package import import_module, require
from .monitor import Monitor

_SECTION = "wandb"


class WandbMonitor(Monitor):
    def __init__(self, section) -> None:
        super().__init__(section)
        self.wandb = import_module("wandb", section=_SECTION, install="wandb")
        self.run = self.wandb.init(
            project=section.project, group=section.group, entity=section.team
        )

    @staticmethod
    def check_installed() -> None:
        require("wandb", section=_SECTION, install="wandb")

    def write_events(self, event_list) -> None:
        for name, value, step in event_list:
            self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()
