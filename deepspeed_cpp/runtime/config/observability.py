"""The config sections that only watch training: monitors, comms_logger, flops_profiler.

Field names and defaults are DeepSpeed's (``deepspeed/monitor/config.py``,
``deepspeed/comm/config.py``, ``deepspeed/profiling/config.py``). None of them changes a result;
they say what is written where. (No ``from __future__ import annotations``: pydantic must see
the field types built by ``integer(...)`` and friends evaluated.)
"""

from typing import Annotated, Any

from pydantic import PlainValidator
from pydantic_core import PydanticCustomError

from .values import ConfigSection, boolean, integer, number, text


def _names():
    """A list of strings (comms_logger.prof_ops: the collectives to profile by name)."""

    def check(value: Any) -> list[str]:
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise PydanticCustomError("ds_config_value", "expected a list of strings")
        return list(value)

    return Annotated[list[str], PlainValidator(check)]


class TensorBoardConfig(ConfigSection):
    """``tensorboard``: scalars to TensorBoard event files under ``output_path/job_name``."""

    enabled: boolean() = False
    output_path: text(optional=True) = ""
    """Folder of the runs; empty or null: ``~/tensorboard``, as DeepSpeed."""
    job_name: text() = "DeepSpeedJobName"


class CSVConfig(ConfigSection):
    """``csv_monitor``: one CSV file per event under ``output_path/job_name``."""

    enabled: boolean() = False
    output_path: text(optional=True) = ""
    """Folder of the runs; empty or null: ``~/csv_monitor``, as DeepSpeed."""
    job_name: text() = "DeepSpeedJobName"


class WandbConfig(ConfigSection):
    """``wandb``: Weights & Biases (``WANDB_MODE=offline`` works without an account)."""

    enabled: boolean() = False
    group: text(optional=True) = None
    team: text(optional=True) = None
    project: text() = "deepspeed"


class CometConfig(ConfigSection):
    """``comet``: Comet ML (``online: false`` or ``mode`` for an offline experiment)."""

    enabled: boolean() = False
    samples_log_interval: integer(1) = 100
    project: text(optional=True) = None
    workspace: text(optional=True) = None
    api_key: text(optional=True) = None
    experiment_name: text(optional=True) = None
    experiment_key: text(optional=True) = None
    online: boolean(optional=True) = None
    mode: text(optional=True) = None


class CommsLoggerConfig(ConfigSection):
    """``comms_logger``: every collective timed and sized; ``deepspeed.comm.log_summary()``."""

    enabled: boolean() = False
    verbose: boolean() = False
    """Log each collective as it completes (rank 0), besides the summary."""
    prof_all: boolean() = True
    """Record every collective; false: only those named in ``prof_ops``."""
    prof_ops: _names() = []
    debug: boolean() = False
    """Name each record after the function that issued the collective too."""


class FlopsProfilerConfig(ConfigSection):
    """``flops_profiler``: one step's model profile printed by rank 0 (or to ``output_file``)."""

    enabled: boolean() = False
    recompute_fwd_factor: number(minimum=0.0) = 0.0
    profile_step: integer(0) = 1
    """The ``global_steps`` whose forward passes are profiled; 0 (the first step) is allowed, as in
    DeepSpeed, which only skips it by default to leave out the first step's warm-up."""
    module_depth: integer(-1) = -1
    top_modules: integer(1) = 1
    detailed: boolean() = True
    output_file: text(optional=True) = None
