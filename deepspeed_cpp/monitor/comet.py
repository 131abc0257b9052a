"""comet: Comet ML experiments (``online: false`` or ``mode`` for an offline one, whose archive
goes to ``COMET_OFFLINE_DIRECTORY``). As in DeepSpeed, each event is logged once
``samples_log_interval`` samples have passed since it was last logged
(``tests/test_monitor.py`` reads an offline archive back)."""

from __future__ import annotations

from .missing_package import import_module, require
from .monitor import Monitor

_SECTION = "comet"


class CometMonitor(Monitor):
    def __init__(self, section) -> None:
        super().__init__(section)
        comet_ml = import_module("comet_ml", section=_SECTION, install="comet_ml")
        self.samples_log_interval = section.samples_log_interval
        self.experiment = comet_ml.start(
            api_key=section.api_key,
            project=section.project,
            workspace=section.workspace,
            experiment_key=section.experiment_key,
            mode=section.mode,
            online=section.online,
        )
        if section.experiment_name is not None:
            self.experiment.set_name(section.experiment_name)
        self._last_logged: dict[str, int] = {}

    @staticmethod
    def check_installed() -> None:
        require("comet_ml", section=_SECTION, install="comet_ml")

    def write_events(self, event_list) -> None:
        for name, value, step in event_list:
            last = self._last_logged.get(name)
            if last is not None and step - last < self.samples_log_interval:
                continue
            self._last_logged[name] = step
            self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()
