"""``deepspeed-cpp`` / ``python -m deepspeed_cpp.launcher``: check the flags, exec torchrun."""

from __future__ import annotations

import os
import shlex
import sys
from collections import OrderedDict

from ..utils.logging import logger
from .arguments import parse_launch_args
from .hostfile import HostfileError, describe_hostfile, parse_hostfile_lines, read_hostfile
from .resource_filter import parse_inclusion_exclusion, parse_resource_filter
from .torchrun_command import build_torchrun_command

__all__ = [
    "fetch_hostfile",
    "main",
    "parse_inclusion_exclusion",
    "parse_resource_filter",
]


def _parse_hostfile(hostfile_lines) -> OrderedDict:
    """DeepSpeed's ``{host: slots}`` of hostfile lines; a malformed, repeated or empty one
    raises ValueError (``HostfileError``) naming the line."""
    return OrderedDict((h.host, h.slots) for h in parse_hostfile_lines(hostfile_lines))


def fetch_hostfile(hostfile_path: str) -> OrderedDict | None:
    """``{host: slots}`` of the hostfile at ``hostfile_path``, or None when there is none (as
    DeepSpeed: no hostfile means this machine alone)."""
    if not os.path.isfile(hostfile_path):
        return None
    return OrderedDict((h.host, h.slots) for h in read_hostfile(hostfile_path))


def main(args: list[str] | None = None) -> None:
    """Parse DeepSpeed's launcher flags and replace this process with torchrun.

    Example, two processes on this machine::

        deepspeed-cpp --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json

    Two nodes: the same command on each, with ``--num_nodes 2 --node_rank 0|1 --master_addr
    <node 0>``. Never returns: torchrun's exit status becomes the launcher's, which is the status
    of the worker that failed first (named on stderr), see ``torchrun_exit_status.py``.
    """
    args = parse_launch_args(args)
    if args.hostfile is not None:
        try:
            hosts = read_hostfile(args.hostfile)
        except HostfileError as error:
            sys.exit(f"deepspeed-cpp: error: {error}")
        for line in describe_hostfile(
            args.hostfile, hosts, args.num_nodes, args.num_procs, args.master_port
        ):
            logger.info(line)
    if args.alias_deepspeed:
        from ..compat import ENV_FLAG, find_real_deepspeed

        # Checked once here for one clear message; each worker checks again when it activates.
        real = find_real_deepspeed()
        if real is not None:
            sys.exit(
                f"deepspeed-cpp: error: --alias-deepspeed: a real 'deepspeed' is {real}; the "
                "alias only stands in where DeepSpeed is absent"
            )
        # torchrun passes the environment to its workers; the trampoline reads this flag.
        os.environ[ENV_FLAG] = "1"
    else:
        # The flag is the only way in: a value inherited from a parent launch does not count.
        os.environ.pop("DEEPSPEED_CPP_ALIAS_DEEPSPEED", None)
    command = build_torchrun_command(args)
    logger.info(
        f"node {args.node_rank}/{args.num_nodes}: {args.num_procs} process(es), rendezvous at "
        f"{args.master_addr}:{args.master_port}; exec {shlex.join(command)}"
    )
    # exec discards anything still buffered in this process.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(command[0], command)
