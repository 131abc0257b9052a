"""Where the test suite's CPU goes: each test's CPU seconds (user and system, of the pytest
process and of every process below it) beside its wall time, summed per test file.

Issue 27 asks for the whole suite in at most 12 minutes on a 2-core machine. Wall times
(``--durations``) cannot say which tests to make cheaper: the suite runs several processes at
once, so a test's wall time includes the others' and hides the CPU of the ranks, launchers,
compilers and scripts it starts. This counts the CPU itself, read from ``/proc`` at the start and
end of every test: the pytest process, every live descendant (zombies included: their time is
still in their ``stat``), and the children already reaped (``RUSAGE_CHILDREN``). Descendants that
outlive their parent are re-parented away from the tree and missed; the summary prints how much
of the run's CPU (the pytest process's own rusage, taken by this script) the tests account for.

Run from the repository root (it sets ``DS_TEST_PREBUILD=0``, so an op is compiled by the first
test that needs it and counted there, not by the background build, whose CPU would land on
whichever test runs beside it)::

    python benchmarks/suite_cpu.py [--out FILE] [--top N] [-- PYTEST ARGS]
    python benchmarks/suite_cpu.py --summarise FILE [--top N]

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_HERE = Path(__file__).resolve().parent


def _stat(pid: str) -> tuple[int, float, float] | None:
    """(parent pid, user + waited-for children's user, system + theirs) of ``pid``, in seconds."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone since the listing
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return int(fields[1]), (utime + cutime) / _TICK, (stime + cstime) / _TICK


def tree_cpu(root: int) -> tuple[float, float]:
    """User and system seconds of process ``root``, of every live (or zombie) process below it,
    and of the children it already reaped."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat(entry)
            if stat is not None:
                stats[int(entry)] = stat
    below: dict[int, list[int]] = defaultdict(list)
    for pid, (parent, _user, _system) in stats.items():
        below[parent].append(pid)
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = own.ru_utime + reaped.ru_utime, own.ru_stime + reaped.ru_stime
    todo = list(below[root])
    while todo:
        pid = todo.pop()
        _parent, pid_user, pid_system = stats[pid]
        user, system = user + pid_user, system + pid_system
        todo.extend(below[pid])
    return user, system


# --- the pytest plugin (``-p suite_cpu`` with this folder on the path) ----------------------------
_started: dict[str, tuple[float, float, float]] = {}
_out = None


def _write(user: float, system: float, wall: float, name: str) -> None:
    _out.write(f"{user:.2f}\t{system:.2f}\t{wall:.2f}\t{name}\n")


def pytest_sessionstart(session) -> None:
    global _out
    _out = open(os.environ["SUITE_CPU_OUT"], "w", buffering=1)  # noqa: SIM115 - whole session
    _write(*tree_cpu(os.getpid()), 0.0, "<session start: interpreter, conftest>")


def pytest_runtest_protocol(item, nextitem) -> None:
    _started[item.nodeid] = (*tree_cpu(os.getpid()), time.monotonic())


def pytest_runtest_logfinish(nodeid, location) -> None:
    if nodeid in _started:
        user, system, wall = _started.pop(nodeid)
        now_user, now_system = tree_cpu(os.getpid())
        _write(now_user - user, now_system - system, time.monotonic() - wall, nodeid)


def pytest_sessionfinish(session) -> None:
    _out.close()


# --- the summary ----------------------------------------------------------------------------------
def summarise(path: Path, top: int, total: tuple[float, float, float] | None = None) -> None:
    tests, start = [], None
    for line in path.read_text().splitlines():
        user, system, wall, name = line.split("\t", 3)
        user, system, wall = float(user), float(system), float(wall)
        if name.startswith("<session start"):
            start = user + system
        elif not name.startswith("<"):  # a test, not a marker row
            tests.append((user + system, user, system, wall, name))
    per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    for _cpu, user, system, wall, name in tests:
        row = per_file[name.split("::")[0]]
        for index, value in enumerate((user, system, wall, 1)):
            row[index] += value
    cpu = sum(test[0] for test in tests)
    user = sum(test[1] for test in tests)
    wall = sum(test[3] for test in tests)
    print(
        f"{len(tests)} tests: {cpu:.0f} CPU s ({user:.0f} user, {cpu - user:.0f} system) in "
        f"{wall:.0f} s of test wall time, {cpu / max(wall, 1e-9):.2f} cores busy on average"
    )
    if start is not None:
        print(f"session start (interpreter, conftest, collection): {start:.0f} CPU s")
    if total is not None:
        run_user, run_system, run_wall = total
        print(
            f"the whole pytest run: {run_user + run_system:.0f} CPU s ({run_user:.0f} user, "
            f"{run_system:.0f} system) in {run_wall:.0f} s wall; the tests account for "
            f"{100 * cpu / max(run_user + run_system, 1e-9):.0f} %"
        )
    print(
        f"\nfiles by CPU (top {top})\n{'CPU s':>8} {'user':>7} {'system':>7} {'wall s':>7} "
        f"{'tests':>5}  file"
    )
    ranked = sorted(per_file.items(), key=lambda item: -(item[1][0] + item[1][1]))
    for name, (file_user, file_system, file_wall, count) in ranked[:top]:
        print(
            f"{file_user + file_system:8.1f} {file_user:7.1f} {file_system:7.1f} "
            f"{file_wall:7.1f} {count:5d}  {name}"
        )
    print(f"\ntests by CPU (top {top})\n{'CPU s':>8} {'system':>7} {'wall s':>7}  test")
    for test_cpu, _user, test_system, test_wall, name in sorted(tests, reverse=True)[:top]:
        print(f"{test_cpu:8.1f} {test_system:7.1f} {test_wall:7.1f}  {name}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("build/suite_cpu.tsv"),
        help="where the per-test rows go (TSV: user, system, wall, test)",
    )
    parser.add_argument("--summarise", type=Path, help="only summarise an earlier run's rows")
    parser.add_argument("--top", type=int, default=40, help="files and tests listed")
    parser.add_argument("pytest_args", nargs="*", help="after --: arguments for pytest")
    args = parser.parse_args(argv)
    if args.summarise is not None:
        summarise(args.summarise, args.top)
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    path = os.pathsep.join(filter(None, [str(_HERE), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, SUITE_CPU_OUT=str(args.out), DS_TEST_PREBUILD="0")
    before, started = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    command = [sys.executable, "-m", "pytest", "-q", "-p", "suite_cpu", *args.pytest_args]
    code = subprocess.run(command, env=env).returncode
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - started
    print()
    summarise(
        args.out,
        args.top,
        (after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime, wall),
    )
    return code


if __name__ == "__main__":
    sys.exit(main())
