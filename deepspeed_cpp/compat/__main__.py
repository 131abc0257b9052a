"""``python -m deepspeed_cpp.compat [-m] TARGET [ARGS...]``: run a script (or, with ``-m``, a
module) as ``__main__`` with the ``import deepspeed`` alias active.

The launcher's ``--alias-deepspeed`` starts every worker through this, so the alias is active
before the first line of the user's script, which stays unmodified. ``sys.argv`` and
``sys.path[0]`` are what ``python TARGET ARGS`` (or ``python -m TARGET ARGS``) would give.
"""

from __future__ import annotations

import os
import runpy
import sys

from . import activate


def main(argv: list[str]) -> None:
    as_module = bool(argv) and argv[0] in ("-m", "--module")
    if as_module:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m deepspeed_cpp.compat [-m] TARGET [ARGS...]: expected a script")
    target, *target_args = argv
    activate()
    sys.argv = [target, *target_args]
    if as_module:
        # python -m puts the working directory first on sys.path; so did starting us with -m.
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(target):
        sys.exit(f"python -m deepspeed_cpp.compat: script {target!r} is not a file")
    # `python script.py` puts the script's folder first on sys.path, not the working directory.
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
