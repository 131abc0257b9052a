"""The launcher: DeepSpeed's command-line flags on top of torchrun (``deepspeed-cpp``).

We never write a rendezvous: the launcher checks its flags and execs torchrun (through
``torchrun_exit_status.py``, so that the launch exits with the status of the worker that failed
first); every worker gets ``--local_rank=N`` as with DeepSpeed.
"""

from .arguments import build_parser, parse_launch_args
from .runner import main
from .torchrun_command import build_torchrun_command

__all__ = ["build_parser", "build_torchrun_command", "main", "parse_launch_args"]
