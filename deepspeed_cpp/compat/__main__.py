"""``python -m deepspeed_cpp.compat SCRIPT | -m MODULE | -c CODE [ARGS...]``: run a script, a
module or a string of code as ``__main__`` with the ``import deepspeed`` alias active.

The launcher's ``--alias-deepspeed`` starts every worker through this, so the alias is active
before the first line of the user's script, which stays unmodified. ``-c`` makes the one-liners
of DeepSpeed's documentation run as written (``python -c 'from deepspeed.runtime.zero.stage3
import ...'`` becomes ``python -m deepspeed_cpp.compat -c '...'``); ``-m deepspeed.<module>``
runs deepspeed_cpp's module of that name. ``sys.argv`` and ``sys.path[0]`` are what ``python
SCRIPT ARGS`` (``python -m MODULE ARGS``, ``python -c CODE ARGS``) would give.
"""

from __future__ import annotations

import os
import runpy
import sys
import types

from . import activate

USAGE = "usage: python -m deepspeed_cpp.compat [SCRIPT | -m MODULE | -c CODE] [ARGS...]"
_OPTIONS = {"-m": "module", "--module": "module", "-c": "code"}


def _run_code(code: str) -> None:
    """As ``python -c``: the code runs in a fresh ``__main__`` module (what pickle and
    multiprocessing look up for the functions it defines), named ``<string>`` in tracebacks."""
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    exec(compile(code, "<string>", "exec"), main_module.__dict__)


def main(argv: list[str]) -> None:
    kind = _OPTIONS.get(argv[0], "script") if argv else "script"
    if kind != "script":
        option, argv = argv[0], argv[1:]
        if not argv:
            sys.exit(f"python -m deepspeed_cpp.compat: {option} expects an argument; {USAGE}")
    if not argv:
        sys.exit(f"python -m deepspeed_cpp.compat: expected a script; {USAGE}")
    target, *target_args = argv
    if kind == "script" and not os.path.isfile(target):
        sys.exit(f"python -m deepspeed_cpp.compat: script {target!r} is not a file; {USAGE}")
    activate()
    if kind == "code":
        sys.argv = ["-c", *target_args]
        sys.path[0] = ""  # python -c: the working directory, as it will be when imports run
        _run_code(target)
    elif kind == "module":
        sys.argv = [target, *target_args]  # runpy puts the module's path in argv[0]
        # python -m puts the working directory first on sys.path; so did starting us with -m.
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *target_args]
        # `python script.py` puts the script's folder first on sys.path, not the working one.
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
