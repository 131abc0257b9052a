"""csv_monitor: one CSV file per event, DeepSpeed's layout.

``output_path/job_name/<event name with '/' and ' ' as '_'>.csv``, a header row ``step,<last
part of the name>`` written when this process first writes the file, then one ``step,value``
row per event (appended: a resumed run continues its files, as DeepSpeed's does)."""

from __future__ import annotations

import csv
import os

from .monitor import Monitor, run_folder


class csvMonitor(Monitor):  # noqa: N801 -- DeepSpeed's class name
    def __init__(self, section) -> None:
        super().__init__(section)
        self.log_dir = run_folder(section.output_path, section.job_name, "csv_monitor")
        os.makedirs(self.log_dir, exist_ok=True)
        self.filenames: list[str] = []

    @staticmethod
    def check_installed() -> None:
        """The csv module is in the standard library."""

    def write_events(self, event_list) -> None:
        for name, value, step in event_list:
            filename = name.replace("/", "_").replace(" ", "_")
            path = os.path.join(self.log_dir, filename + ".csv")
            with open(path, "a+", newline="") as file:
                writer = csv.writer(file)
                if filename not in self.filenames:
                    self.filenames.append(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, _plain(value)])


def _plain(value):
    """A tensor or numpy scalar as the Python number it holds."""
    return value.item() if hasattr(value, "item") else value
