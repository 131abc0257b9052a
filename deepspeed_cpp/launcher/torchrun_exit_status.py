"""Run by the launcher in place of ``python -m torch.distributed.run``: torchrun itself, exiting
with the exit status of the worker that failed first, and saying which worker that was.

torchrun exits 1 whatever its workers' statuses were, so a job scheduler or a wrapper script
cannot tell a worker's own ``sys.exit(3)`` (a bad config, a preemption the script signals) from
any other failure. This calls torchrun's own ``main`` unchanged and, when it fails because a
worker did (``ChildFailedError``), takes the failure torchrun itself reports as the root cause
(``get_first_failure``: the earliest one observed, the lowest rank among ties), prints torchrun's
summary and one line naming that worker, and exits with that worker's status. A worker killed
by a signal gives 128 + the signal number, as a shell reports it.

Command line (built by ``deepspeed_cpp.launcher.torchrun_command``): torchrun's own arguments.
It is run by path, like ``local_rank_trampoline.py``, so that the only package it imports is
torch, which torchrun imports anyway.
"""

import os
import sys


def exit_status(worker_exitcode: int) -> int:
    """The launcher's exit status for a worker's: its own code, or 128 + N for signal N."""
    return 128 - worker_exitcode if worker_exitcode < 0 else worker_exitcode


def describe_failure(rank: int, failure) -> str:
    """One line naming the worker that failed first and how (``failure``: torchrun's
    ``ProcessFailure``)."""
    if failure.exitcode < 0:
        how = f"was killed by signal {-failure.exitcode} ({failure.signal_name()})"
    else:
        how = f"exited with status {failure.exitcode}"
    status = exit_status(failure.exitcode)
    return (
        f"deepspeed-cpp: worker rank {rank} (local rank {failure.local_rank}, pid {failure.pid}) "
        f"{how}, the first worker to fail; the launch exits with status {status}"
    )


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except ChildFailedError as failed:
        rank, failure = failed.get_first_failure()
        print(failed.format_msg(), file=sys.stderr)
        print(describe_failure(rank, failure), file=sys.stderr, flush=True)
        return exit_status(failure.exitcode)
    return 0


if __name__ == "__main__":
    # Run by path, Python puts this folder first on sys.path; its module names (runner,
    # arguments, ...) must not shadow anything torch imports.
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    sys.exit(main(sys.argv[1:]))
