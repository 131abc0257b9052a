"""``deepspeed_cpp.monitor``: training scalars to TensorBoard, CSV files, Weights & Biases, Comet.

DeepSpeed's module path and names: ``MonitorMaster(config)`` fans ``write_events([(name, value,
step)])`` out to every enabled back-end, on rank 0 only. A back-end's package is imported only
when its section is enabled; a missing one is a ``MissingMonitorPackageError`` naming what to
install.
"""

from .missing_package import MissingMonitorPackageError
from .monitor import Monitor, MonitorMaster

__all__ = ["MissingMonitorPackageError", "Monitor", "MonitorMaster"]
