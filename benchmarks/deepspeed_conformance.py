"""DeepSpeed's own unit tests as our conformance suite (issue 26). Not part of CI (it needs a
checkout of DeepSpeed's tests, which CI cannot fetch).

    python benchmarks/deepspeed_conformance.py --tests /path/to/DeepSpeed/tests \
        [--deepspeed-python /venv-with-deepspeed/bin/python] [--files a.py b.py] [--timeout 900]

Runs every "in" file of ``benchmarks/deepspeed_conformance_files.txt`` with pytest, one file at a
time, under this Python with ``import deepspeed`` aliased to deepspeed_cpp (a ``sitecustomize``
that calls ``deepspeed_cpp.compat.activate()``, so spawned ranks see the alias too), and, given
``--deepspeed-python``, under real DeepSpeed. ``DS_ACCELERATOR=cpu`` and ``LOCAL_SIZE=2`` (so the
suite's ``DistributedTest`` runs world sizes up to 2 on a CPU) are set for both. Prints per file:
collected / passed / skipped / failed for each library, then the failure reasons grouped (the
exception's first line), and the DeepSpeed commit of the checkout when it is a git folder.
A stratified random sample of every in-scope file, with an estimate over all of them:
``benchmarks/deepspeed_conformance_sample.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
FILE_LIST = HERE / "deepspeed_conformance_files.txt"
ALIAS_SITECUSTOMIZE = "import deepspeed_cpp.compat\ndeepspeed_cpp.compat.activate()\n"


def in_scope_files(listing: Path = FILE_LIST) -> list[str]:
    files = []
    for line in listing.read_text().splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) == 2 and fields[0] == "in":
            files.append(fields[1])
    return files


def _reason(case: ElementTree.Element) -> str:
    for tag in ("failure", "error"):
        element = case.find(tag)
        if element is not None:
            message = (element.get("message") or element.text or tag).strip()
            return message.splitlines()[0][:160] if message else tag
    return ""


def run_file(python: str, tests: Path, path: str, env: dict, timeout: float,
             keyword: str | None = None) -> dict:  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.xml"
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", path,
                   f"--junitxml={report}", "-o", "junit_family=xunit2"]  # fmt: skip
        if keyword:
            command += ["-k", keyword]
        try:
            subprocess.run(command, cwd=tests, env=env, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"collected": 0, "passed": 0, "skipped": 0, "failed": 0,
                    "reasons": [f"timed out after {timeout:g} s"]}  # fmt: skip
        if not report.is_file():
            return {"collected": 0, "passed": 0, "skipped": 0, "failed": 0,
                    "reasons": ["pytest wrote no report"]}  # fmt: skip
        counts = collections.Counter()
        reasons = []
        for case in ElementTree.parse(report).iter("testcase"):
            counts["collected"] += 1
            if case.find("skipped") is not None:
                counts["skipped"] += 1
            elif case.find("failure") is not None or case.find("error") is not None:
                counts["failed"] += 1
                reasons.append(_reason(case))
            else:
                counts["passed"] += 1
        return {**{k: counts[k] for k in ("collected", "passed", "skipped", "failed")},
                "reasons": reasons}  # fmt: skip


# A pytest plugin (loaded with -p) that writes what collection found: the suite's conftest forces
# a verbose tree output, which is no format to parse.
COLLECT_PLUGIN = """
import json, os

_errors = {}


def pytest_collectreport(report):
    if report.failed:
        text = str(report.longrepr).strip().splitlines()
        last = [line for line in text if line.startswith("E   ")] or text[-1:]
        _errors[report.nodeid] = last[-1][4:].strip() if last else "collection failed"


def pytest_collection_finish(session):
    with open(os.environ["CONFORMANCE_COLLECT_OUT"], "w") as out:
        json.dump({"items": [item.nodeid for item in session.items], "errors": _errors}, out)
"""


def collect_files(python: str, tests: Path, paths: list[str], env: dict, timeout: float) -> dict:
    """Collection only, every file in one pytest process (each DistributedTest run spawns fresh
    ranks, ~25 s a test on 2 busy cores, so a full run of every file takes hours): per file,
    the tests collected (count and node ids) and, where the file does not import, the error's
    last line."""
    results = {path: {"collected": 0, "error": "", "ids": []} for path in paths}
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "conformance_collect.py").write_text(COLLECT_PLUGIN)
        out = Path(scratch, "collected.json")
        env = dict(env, CONFORMANCE_COLLECT_OUT=str(out))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (scratch, env.get("PYTHONPATH")) if p)
        command = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p",
                   "conformance_collect", "--continue-on-collection-errors", *paths]  # fmt: skip
        try:
            subprocess.run(command, cwd=tests, env=env, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout:g} s"
            return {p: {"collected": 0, "error": error, "ids": []} for p in paths}
        if not out.is_file():
            return {p: {"collected": 0, "error": "no collection", "ids": []} for p in paths}
        found = json.loads(out.read_text())
    for nodeid in found["items"]:
        path = nodeid.split("::", 1)[0]
        if path in results:
            results[path]["collected"] += 1
            results[path]["ids"].append(nodeid)
    for nodeid, error in found["errors"].items():
        if nodeid in results:
            results[nodeid]["error"] = error[:160]
    return results


def collect_main(args, files: list[str]) -> int:
    with tempfile.TemporaryDirectory() as alias_dir:
        Path(alias_dir, "sitecustomize.py").write_text(ALIAS_SITECUSTOMIZE)
        runs = {"deepspeed_cpp": (sys.executable, _environment(alias_dir, args.alias_path))}
        if args.deepspeed_python:
            runs["DeepSpeed"] = (args.deepspeed_python, _environment(None))
        results = {lib: collect_files(py, args.tests, files, env, args.timeout)
                   for lib, (py, env) in runs.items()}  # fmt: skip
    print("file".ljust(60) + "".join(f" | {lib:>13}" for lib in results))
    totals = collections.Counter()
    for path in files:
        cells = []
        for lib, per_file in results.items():
            totals[lib] += per_file[path]["collected"]
            cells.append(f" | {per_file[path]['collected']:>13}")
        print(path[-60:].ljust(60) + "".join(cells))
    print("total".ljust(60) + "".join(f" | {totals[lib]:>13}" for lib in results))
    for lib, per_file in results.items():
        errors = {p: r["error"] for p, r in per_file.items() if r["error"]}
        print(f"\ncollection errors, {lib}: {len(errors)}")
        for path, error in errors.items():
            print(f"  {path}: {error}")
    return 0


def _environment(sitecustomize_dir: str | None, extra_paths: tuple = ()) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2", OMP_NUM_THREADS="1")
    if sitecustomize_dir:
        paths = [sitecustomize_dir, str(HERE.parent), *extra_paths, env.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=Path, required=True, help="DeepSpeed's tests/ folder")
    parser.add_argument("--deepspeed-python", help="a Python with real DeepSpeed installed")
    parser.add_argument("--files", nargs="*", help="run these files instead of the list")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per file")
    parser.add_argument("--commit", help="DeepSpeed commit of --tests when it is not a git folder")
    parser.add_argument("-k", "--keyword", help="pytest -k expression (e.g. leave out slow "
                        "DistributedTest classes)")  # fmt: skip
    parser.add_argument("--alias-path", nargs="*", default=(),
                        help="folders for the alias run's PYTHONPATH: the suite's own test "
                        "dependencies (hjson, py-cpuinfo) without DeepSpeed")  # fmt: skip
    parser.add_argument("--collect-only", action="store_true",
                        help="only collect: per file, tests collected, import errors")  # fmt: skip
    args = parser.parse_args(argv)
    files = args.files or in_scope_files()
    if args.collect_only:
        return collect_main(args, files)
    commit = subprocess.run(["git", "-C", str(args.tests), "rev-parse", "HEAD"],
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    commit = args.commit or commit
    print(f"DeepSpeed tests: {args.tests} (commit {commit or 'unknown'})")
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory() as alias_dir:
        Path(alias_dir, "sitecustomize.py").write_text(ALIAS_SITECUSTOMIZE)
        runs = {"deepspeed_cpp": (sys.executable, _environment(alias_dir, args.alias_path))}
        if args.deepspeed_python:
            runs["DeepSpeed"] = (args.deepspeed_python, _environment(None))
        for path in files:
            results[path] = {}
            for library, (python, env) in runs.items():
                results[path][library] = run_file(
                    python, args.tests, path, env, args.timeout, args.keyword
                )
                r = results[path][library]
                print(f"  {path} [{library}]: {r['collected']} collected, {r['passed']} passed, "
                      f"{r['skipped']} skipped, {r['failed']} failed", flush=True)  # fmt: skip
    print()
    libraries = list(next(iter(results.values())).keys()) if results else []
    header = "file".ljust(60) + "".join(f" | {lib:^27}" for lib in libraries)
    print(header)
    print(" " * 60 + " | coll  pass  skip  fail      " * len(libraries))
    totals = {lib: collections.Counter() for lib in libraries}
    for path, per_library in results.items():
        cells = []
        for lib in libraries:
            r = per_library[lib]
            totals[lib].update({k: r[k] for k in ("collected", "passed", "skipped", "failed")})
            cells.append(f" | {r['collected']:>4} {r['passed']:>5} {r['skipped']:>5} "
                         f"{r['failed']:>5}      ")  # fmt: skip
        print(path[-60:].ljust(60) + "".join(cells))
    print("total".ljust(60) + "".join(
        f" | {t['collected']:>4} {t['passed']:>5} {t['skipped']:>5} {t['failed']:>5}      "
        for t in totals.values()))  # fmt: skip
    for lib in libraries:
        grouped = collections.Counter(
            reason for per_library in results.values() for reason in per_library[lib]["reasons"]
        )
        print(f"\nfailure reasons, {lib}:")
        for reason, count in grouped.most_common(40):
            print(f"  {count:>5}  {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
