"""tensorboard: scalars through torch's SummaryWriter (which needs the ``tensorboard`` package)
into ``output_path/job_name``, as DeepSpeed writes them."""

from __future__ import annotations

from .missing_package import import_module, require
from .monitor import Monitor, run_folder

_SECTION = "tensorboard"


class TensorBoardMonitor(Monitor):
    def __init__(self, section) -> None:
        super().__init__(section)
        self.log_dir = run_folder(section.output_path, section.job_name, "tensorboard")
        writer = import_module("torch.utils.tensorboard", section=_SECTION, install="tensorboard")
        self.summary_writer = writer.SummaryWriter(log_dir=self.log_dir)

    @staticmethod
    def check_installed() -> None:
        require("tensorboard", section=_SECTION, install="tensorboard")

    def write_events(self, event_list, flush: bool = True) -> None:
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        if flush:
            # Flushed every call, as DeepSpeed does: a crash loses no curve a user saw written.
            self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()
