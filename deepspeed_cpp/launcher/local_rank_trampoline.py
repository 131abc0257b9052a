"""Run by torchrun in each worker: re-exec the user's program with ``--local_rank=N`` appended.

torchrun tells a worker its local rank only through the ``LOCAL_RANK`` variable, while scripts
written for DeepSpeed's launcher expect it on the command line as well (``--local_rank=N`` right
after the script name, before the script's own arguments). This file bridges the two. It is run
by path, not as ``-m deepspeed_cpp...``, so that it imports neither torch nor this package: the
exec that replaces it costs milliseconds and keeps the process id torchrun watches.

Command line (built by ``deepspeed_cpp.launcher.torchrun_command``, not meant for people):

    local_rank_trampoline.py MODE LOCAL_RANK_ARG TARGET [TARGET_ARGS...]

MODE: ``python`` (run TARGET as a script with this interpreter), ``module`` (``python -m
TARGET``) or ``exec`` (TARGET is an executable). LOCAL_RANK_ARG: ``local_rank`` to pass
``--local_rank=N``, ``no_local_rank`` to pass nothing.

It also sets the variables DeepSpeed's launcher gives each worker beyond torchrun's own:
``LOCAL_SIZE`` (processes on this node), ``CROSS_RANK`` (this node's rank) and ``CROSS_SIZE``
(number of nodes).
"""

import os
import sys
from typing import NoReturn

MODES = ("python", "module", "exec")
# Set by the launcher's --alias-deepspeed (deepspeed_cpp.compat.ENV_FLAG; repeated here because
# this file imports nothing from the package): the worker then starts through
# ``python -m deepspeed_cpp.compat``, which activates the ``import deepspeed`` alias before the
# user's code runs.
ALIAS_ENV_FLAG = "DEEPSPEED_CPP_ALIAS_DEEPSPEED"
LOCAL_RANK_ARGS = ("local_rank", "no_local_rank")


def _fail(message: str) -> NoReturn:
    print(f"deepspeed_cpp local_rank_trampoline: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def worker_command(argv: list[str], env: dict) -> list[str]:
    """The command this worker execs, from the trampoline's arguments and torchrun's env."""
    if len(argv) < 3:
        _fail(f"expected MODE LOCAL_RANK_ARG TARGET [ARGS...], got {argv!r}")
    mode, local_rank_arg, target, *target_args = argv
    if mode not in MODES:
        _fail(f"MODE is {mode!r}; expected one of {MODES}")
    if local_rank_arg not in LOCAL_RANK_ARGS:
        _fail(f"LOCAL_RANK_ARG is {local_rank_arg!r}; expected one of {LOCAL_RANK_ARGS}")
    local_rank = env.get("LOCAL_RANK")
    if local_rank is None or not local_rank.isdigit():
        _fail(
            f"LOCAL_RANK is {local_rank!r}; this program is started by torchrun through "
            "'python -m deepspeed_cpp.launcher', which sets it"
        )

    alias = env.get(ALIAS_ENV_FLAG) == "1"
    if alias and mode == "exec":
        _fail(f"{ALIAS_ENV_FLAG}=1 needs a Python worker; {target!r} is run as an executable")
    bootstrap = ["-m", "deepspeed_cpp.compat"] if alias else []
    if mode == "python":
        command = [sys.executable, "-u", *bootstrap, target]
    elif mode == "module":
        command = [sys.executable, "-u", *bootstrap, "-m", target]
    else:
        command = [target]
    if local_rank_arg == "local_rank":
        command.append(f"--local_rank={local_rank}")
    return command + target_args


def deepspeed_launcher_env(env: dict) -> dict:
    """``env`` plus DeepSpeed's LOCAL_SIZE / CROSS_RANK / CROSS_SIZE, derived from torchrun's."""
    env = dict(env)
    local_size = int(env.get("LOCAL_WORLD_SIZE", "1"))
    world_size = int(env.get("WORLD_SIZE", str(local_size)))
    env.setdefault("LOCAL_SIZE", str(local_size))
    env.setdefault("CROSS_RANK", env.get("GROUP_RANK", "0"))
    # torchrun starts the same number of workers on every node, so the division is exact.
    env.setdefault("CROSS_SIZE", str(max(1, world_size // max(1, local_size))))
    return env


def main() -> None:
    command = worker_command(sys.argv[1:], os.environ)
    env = deepspeed_launcher_env(os.environ)
    try:
        if command[0] == sys.executable:
            os.execve(command[0], command, env)
        else:
            os.execvpe(command[0], command, env)
    except OSError as error:
        _fail(f"cannot execute {command[0]!r}: {error}")


if __name__ == "__main__":
    main()
