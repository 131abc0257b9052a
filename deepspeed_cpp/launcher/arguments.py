"""The launcher's command line: DeepSpeed's common flags, checked, with clear refusals.

Flags of DeepSpeed's launcher that only make sense for its own ssh/pdsh multi-node machinery
(``--include``, ``--exclude``, ``--launcher``, ...) are recognised and refused with a message
saying what to do instead, rather than being mistaken for the user's script or ignored.
"""

from __future__ import annotations

import argparse
import os

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

# Flag -> (takes a value, why it is refused and what to do instead).
UNSUPPORTED_FLAGS: dict[str, tuple[bool, str]] = {
    "--include": (
        True,
        "choose devices with CUDA_VISIBLE_DEVICES and the count with --num_gpus; "
        "multi-node runs start the launcher on each node",
    ),
    "--exclude": (
        True,
        "choose devices with CUDA_VISIBLE_DEVICES and the count with --num_gpus; "
        "multi-node runs start the launcher on each node",
    ),
    "--launcher": (True, "torchrun is the only launcher; run this command on every node"),
    "--launcher_args": (True, "torchrun is the only launcher; run this command on every node"),
    "--ssh_port": (True, "no ssh is used; run this command on every node"),
    "--force_multi": (False, "run this command on every node with --num_nodes/--node_rank"),
    "--autotuning": (True, "autotuning is not implemented"),
    "--elastic_training": (False, "elastic training is not implemented"),
    "--bind_cores_to_rank": (False, "core binding is not implemented; use numactl or taskset"),
    "--bind_core_list": (True, "core binding is not implemented; use numactl or taskset"),
    "--enable_each_rank_log": (True, "per-rank log files are not implemented"),
    "--save_pid": (False, "pid files are not implemented"),
}


SHORT_FLAGS = {"--include": ("-i",), "--exclude": ("-e",)}  # DeepSpeed's short forms


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of ``deepspeed-cpp`` / ``python -m deepspeed_cpp.launcher``."""
    parser = argparse.ArgumentParser(
        prog="deepspeed-cpp",
        # No abbreviations: a shortened flag must never silently mean a different one.
        allow_abbrev=False,
        description=(
            "Start a DeepSpeed-style training script on this node through torchrun. Each worker "
            "gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in its environment and "
            "--local_rank=N on its command line, as with DeepSpeed's launcher. For several "
            "nodes, run the same command on each node with its own --node_rank."
        ),
    )
    parser.add_argument(
        "--num_gpus",
        "--num_procs",
        "--num_accelerators",
        dest="num_procs",
        type=int,
        default=None,
        metavar="N",
        help="processes (workers) on this node; default: the accelerator's device count "
        "(GPUs on CUDA, 1 on the CPU)",
    )
    parser.add_argument(
        "--num_nodes", type=int, default=None, metavar="N", help="number of nodes (default 1)"
    )
    parser.add_argument(
        "--node_rank", type=int, default=0, metavar="R", help="this node's rank (default 0)"
    )
    parser.add_argument(
        "--master_addr",
        default="127.0.0.1",
        metavar="HOST",
        help="address of node 0, where the rendezvous store runs (default 127.0.0.1)",
    )
    parser.add_argument(
        "--master_port",
        type=int,
        default=TORCH_DISTRIBUTED_DEFAULT_PORT,
        metavar="PORT",
        help=f"free port on node 0 (default {TORCH_DISTRIBUTED_DEFAULT_PORT})",
    )
    parser.add_argument(
        "--hostfile",
        default=None,
        metavar="PATH",
        help="DeepSpeed hostfile ('hostname slots=N' lines); read for information only: the "
        "launcher prints the hosts and the command each must run",
    )
    parser.add_argument(
        "--module",
        "-m",
        action="store_true",
        help="run user_script as a Python module (python -m user_script)",
    )
    parser.add_argument(
        "--no_python",
        action="store_true",
        help="user_script is an executable, not a Python script",
    )
    parser.add_argument(
        "--no_local_rank",
        action="store_true",
        help="do not pass --local_rank=N to the script (it reads LOCAL_RANK instead)",
    )
    parser.add_argument(
        "--alias-deepspeed",
        "--alias_deepspeed",
        dest="alias_deepspeed",
        action="store_true",
        help="inside every worker, make `import deepspeed` (and importlib.metadata's 'deepspeed') "
        "resolve to deepspeed_cpp, for scripts that cannot change a line; refused when a real "
        "deepspeed is importable (deepspeed_cpp.compat)",
    )
    for flag, (takes_value, _) in UNSUPPORTED_FLAGS.items():
        names = [flag, *SHORT_FLAGS.get(flag, ())]
        if takes_value:
            parser.add_argument(*names, default=None, help=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
    parser.add_argument("user_script", help="the training script (or module / executable)")
    parser.add_argument(
        "user_args", nargs=argparse.REMAINDER, help="arguments passed on to the script"
    )
    return parser


def parse_launch_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse and check the launcher's arguments; bad ones exit with a message naming them."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.include or args.exclude) and (args.num_nodes is not None or args.num_procs):
        # DeepSpeed refuses this mix with a ValueError before anything else; so do we.
        raise ValueError(
            "--num_nodes/--num_gpus cannot be combined with -i/--include or -e/--exclude: the "
            "filters choose the hosts and slots themselves"
        )
    if args.num_nodes is None:
        args.num_nodes = 1
    for flag, (_, instead) in UNSUPPORTED_FLAGS.items():
        value = getattr(args, flag.lstrip("-"))
        if value is not None:
            shown = flag if value is True else f"{flag} {value}"
            parser.error(f"{shown}: not supported by the deepspeed_cpp launcher; {instead}")
    if args.num_procs is None:
        from ..accelerator import get_accelerator

        args.num_procs = get_accelerator().device_count()
        if args.num_procs < 1:
            parser.error(
                f"--num_gpus was not given and the accelerator "
                f"{get_accelerator().device_name()!r} reports {args.num_procs} devices; "
                "pass --num_gpus N (or --num_procs N)"
            )
    if args.num_procs < 1:
        parser.error(f"--num_gpus/--num_procs is {args.num_procs}; expected at least 1")
    if args.num_nodes < 1:
        parser.error(f"--num_nodes is {args.num_nodes}; expected at least 1")
    if not 0 <= args.node_rank < args.num_nodes:
        parser.error(
            f"--node_rank is {args.node_rank}; expected 0 <= node_rank < --num_nodes "
            f"({args.num_nodes})"
        )
    if not 1 <= args.master_port <= 65535:
        parser.error(f"--master_port is {args.master_port}; expected a port in 1..65535")
    if not args.master_addr:
        parser.error("--master_addr is empty; expected the host name or address of node 0")
    if args.module and args.no_python:
        parser.error("--module and --no_python exclude each other; pass at most one")
    if args.alias_deepspeed and args.no_python:
        parser.error(
            "--alias-deepspeed works inside Python workers; with --no_python the program is an "
            "executable the alias cannot reach"
        )
    if not args.module and not args.no_python and not os.path.isfile(args.user_script):
        parser.error(
            f"user_script {args.user_script!r} is not a file (working directory "
            f"{os.getcwd()!r}); pass --module to run a module or --no_python for an executable"
        )
    return args
