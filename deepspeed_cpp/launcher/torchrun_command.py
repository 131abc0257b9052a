"""The torchrun command line the launcher execs, built from its checked arguments."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

TRAMPOLINE = Path(__file__).resolve().with_name("local_rank_trampoline.py")
TORCHRUN = Path(__file__).resolve().with_name("torchrun_exit_status.py")


def build_torchrun_command(args: argparse.Namespace, python: str = sys.executable) -> list[str]:
    """torchrun with the matching flags, then the trampoline. torchrun runs through
    ``torchrun_exit_status.py``, so the launch exits with the first failing worker's status.

    torchrun's static rendezvous (its default) meets the nodes at ``master_addr:master_port``,
    node 0 hosting the store; each worker is started as ``python local_rank_trampoline.py ...``
    (torchrun's ``--no_python``), which execs the user's program with ``--local_rank=N``.
    """
    if args.module:
        mode = "module"
    elif args.no_python:
        mode = "exec"
    else:
        mode = "python"
    local_rank_arg = "no_local_rank" if args.no_local_rank else "local_rank"
    return [
        python,
        str(TORCHRUN),
        f"--nproc_per_node={args.num_procs}",
        f"--nnodes={args.num_nodes}",
        f"--node_rank={args.node_rank}",
        f"--master_addr={args.master_addr}",
        f"--master_port={args.master_port}",
        "--no_python",
        python,
        str(TRAMPOLINE),
        mode,
        local_rank_arg,
        args.user_script,
        *args.user_args,
    ]
