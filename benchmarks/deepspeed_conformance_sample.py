"""A stratified random sample of DeepSpeed's unit tests as conformance estimate (issue 26).

A full run of every in-scope file takes ~10 hours per library (each ``DistributedTest`` spawns
fresh ranks), so this estimates the issue's figure instead: of the in-scope tests that pass under
real DeepSpeed, the share that pass under deepspeed_cpp. Three steps, each a command:

    # 1. collect every in-scope file under DeepSpeed, pick K ids per file (seeded), write them
    python benchmarks/deepspeed_conformance_sample.py sample --tests T --deepspeed-python P \\
        --per-file 2 --seed 26 --ids-out ids.json
    # 2. run exactly those ids under one library (twice: once each, in parallel if you like)
    python benchmarks/deepspeed_conformance_sample.py run --tests T --ids ids.json \\
        --library deepspeed_cpp --alias-path DEPS --results-out ours.json
    python benchmarks/deepspeed_conformance_sample.py run --tests T --ids ids.json \\
        --library DeepSpeed --deepspeed-python P --results-out theirs.json
    # 3. per-file table for both, failure reasons grouped, estimate with its standard error
    python benchmarks/deepspeed_conformance_sample.py report --ids ids.json \\
        --results ours.json theirs.json

A second, independent sample: ``sample --seed 27 --exclude ids26.json`` leaves the first sample's
ids out of the pool, so the two together are one simple random sample of 2K ids per file (an SRS
of K, then an SRS of K from the rest); ``report --ids ids26.json ids27.json`` combines them into
that 2K-per-file sample and its estimate.

``run --only-failed ours.json`` reruns only the ids that did not pass in an earlier result (after
a fix) and merges the new outcomes over the old ones in ``--results-out``; ``run --resume``
continues an interrupted run, skipping the ids its ``--results-out`` already holds.

The estimate: files are strata. In file f, N_f tests collected under DeepSpeed, n_f sampled; x = 1
where the test passes under DeepSpeed, y = 1 where it passes under both. The ratio R = sum_f N_f
mean_f(y) / sum_f N_f mean_f(x) with the linearised stratified variance
Var(R) = sum_f N_f^2 (1 - n_f/N_f) s_f^2(y - R x) / n_f / X^2, X = sum_f N_f mean_f(x).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from deepspeed_conformance import (
    ALIAS_SITECUSTOMIZE,
    _environment,
    collect_files,
    in_scope_files,
)

LIBRARIES = ("deepspeed_cpp", "DeepSpeed")

# A pytest plugin (loaded with -p) that writes each test's outcome and, for a failure, the
# exception's line: junit's classname/name do not map back to node ids for parametrized classes.
OUTCOME_PLUGIN = """
import json, os

_outcomes = {}


def _reason(report):
    if isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:160]
    text = str(report.longrepr or "").strip().splitlines()
    errors = [line[1:].strip() for line in text if line.startswith("E ")]
    if errors:  # the exception's own lines, not the location pytest's crash line may give
        named = [line for line in errors if "Error" in line or "Exception" in line]
        return (named or errors)[-1 if named else 0][:160]
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None and crash.message.strip():
        return crash.message.strip().splitlines()[0][:160]
    return text[-1][:160] if text else report.outcome


def pytest_runtest_logreport(report):
    previous = _outcomes.get(report.nodeid, ("passed", ""))
    if previous[0] == "failed":
        return
    if report.failed:
        _outcomes[report.nodeid] = ("failed", _reason(report))
    elif report.skipped:
        _outcomes[report.nodeid] = ("skipped", _reason(report))
    elif report.when == "call":
        _outcomes[report.nodeid] = ("passed", "")


def pytest_sessionfinish(session):
    with open(os.environ["CONFORMANCE_OUTCOMES_OUT"], "w") as out:
        json.dump(_outcomes, out)
"""


def sample(args) -> int:
    files = args.files or in_scope_files()
    env = _environment(None)
    found = collect_files(args.deepspeed_python, args.tests, files, env, args.timeout)
    excluded = set()
    for earlier in args.exclude:
        excluded.update(i for f in _load_ids(earlier)["files"].values() for i in f["ids"])
    rng = random.Random(args.seed)
    chosen = {}
    for path in files:
        ids = sorted(found[path]["ids"])
        pool = [i for i in ids if i not in excluded]
        picked = sorted(rng.sample(pool, min(args.per_file, len(pool))))
        # "collected" stays the file's whole count N_f: the stratum's size for the estimate.
        chosen[path] = {"collected": len(ids), "error": found[path]["error"], "ids": picked}
    record = {"seed": args.seed, "per_file": args.per_file, "commit": _commit(args),
              "collected_under": "DeepSpeed", "excluded": list(args.exclude),
              "files": chosen}  # fmt: skip
    Path(args.ids_out).write_text(json.dumps(record, indent=1) + "\n")
    total = sum(f["collected"] for f in chosen.values())
    picked = sum(len(f["ids"]) for f in chosen.values())
    print(f"{len(files)} files, {total} tests collected under DeepSpeed, {picked} sampled "
          f"(seed {args.seed}) -> {args.ids_out}")  # fmt: skip
    return 0


def _load_ids(path: str) -> dict:
    record = json.loads(Path(path).read_text())
    if "files" not in record or "seed" not in record:
        raise SystemExit(f"{path}: not an ids file written by `sample` (no 'files'/'seed' keys)")
    return record


def combine_samples(paths: list[str]) -> dict:
    """Several samples of the same collection as one: per file the union of the sampled ids.
    Samples drawn with ``--exclude`` of the earlier ones are disjoint, so the union is a simple
    random sample of their summed size in each file."""
    records = [_load_ids(p) for p in paths]
    first = records[0]
    files = {}
    for path, record in zip(paths, records):
        if record["commit"] != first["commit"]:
            raise SystemExit(
                f"{path}: DeepSpeed tests commit {record['commit']}, but "
                f"{paths[0]} has {first['commit']}; samples must share a commit"
            )
        for name, entry in record["files"].items():
            merged = files.setdefault(
                name, {"collected": entry["collected"], "error": entry["error"], "ids": []}
            )
            if merged["collected"] != entry["collected"]:
                raise SystemExit(
                    f"{path}: {name} collected {entry['collected']} tests, "
                    f"{merged['collected']} in an earlier sample"
                )
            repeated = set(merged["ids"]) & set(entry["ids"])
            if repeated:
                raise SystemExit(
                    f"{path}: {name} samples {sorted(repeated)[0]} again; draw "
                    "the later sample with `sample --exclude` of the earlier"
                )
            merged["ids"] = sorted(merged["ids"] + entry["ids"])
    return {
        "seed": "+".join(str(r["seed"]) for r in records),
        "per_file": sum(r["per_file"] for r in records),
        "commit": first["commit"],
        "collected_under": first.get("collected_under", "DeepSpeed"),
        "files": files,
    }


def _commit(args) -> str:
    found = subprocess.run(["git", "-C", str(args.tests), "rev-parse", "HEAD"],
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return getattr(args, "commit", None) or found or "unknown"


def run_ids(python: str, tests: Path, ids: list[str], env: dict, timeout: float) -> dict:
    """One pytest process for the ids of one file: {id: [outcome, reason]}; an id pytest never
    reported (a crash, a timeout) counts as failed with that reason."""
    with tempfile.TemporaryDirectory() as scratch:
        Path(scratch, "conformance_outcomes.py").write_text(OUTCOME_PLUGIN)
        out = Path(scratch, "outcomes.json")
        env = dict(env, CONFORMANCE_OUTCOMES_OUT=str(out))
        env["PYTHONPATH"] = ":".join(p for p in (scratch, env.get("PYTHONPATH")) if p)
        command = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                   "conformance_outcomes", *ids]  # fmt: skip
        missing = "pytest reported nothing for this id (not collected, or a crash)"
        try:
            subprocess.run(command, cwd=tests, env=env, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            missing = f"timed out after {timeout:g} s (file's sample)"
        outcomes = json.loads(out.read_text()) if out.is_file() else {}
    if not outcomes and len(ids) > 1 and "timed out" not in missing:
        # One id this library does not collect (a parametrization it lacks) makes pytest refuse
        # the whole command line: run each id alone, so the others still count.
        return {
            k: v
            for nodeid in ids
            for k, v in run_ids(python, tests, [nodeid], env, timeout).items()
        }
    return {nodeid: list(outcomes.get(nodeid, ("failed", missing))) for nodeid in ids}


def run(args) -> int:
    record = json.loads(Path(args.ids).read_text())
    previous = json.loads(Path(args.only_failed).read_text()) if args.only_failed else None
    with tempfile.TemporaryDirectory() as alias_dir:
        if args.library == "deepspeed_cpp":
            Path(alias_dir, "sitecustomize.py").write_text(ALIAS_SITECUSTOMIZE)
            python, env = sys.executable, _environment(alias_dir, args.alias_path)
        else:
            if not args.deepspeed_python:
                raise SystemExit("run --library DeepSpeed needs --deepspeed-python")
            python, env = args.deepspeed_python, _environment(None)
        results = dict(previous["outcomes"]) if previous else {}
        done = {}
        if args.resume and Path(args.results_out).is_file():
            done = json.loads(Path(args.results_out).read_text())["outcomes"]
            results.update(done)
        for path, entry in record["files"].items():
            ids = [i for i in entry["ids"] if i not in done]
            if previous:
                ids = [i for i in ids if previous["outcomes"].get(i, ["failed"])[0] != "passed"]
            if not ids:
                continue
            outcomes = run_ids(python, args.tests, ids, env, args.timeout)
            results.update(outcomes)
            tally = collections.Counter(o for o, _ in outcomes.values())
            print(f"  {path} [{args.library}]: {len(ids)} run, {tally['passed']} passed, "
                  f"{tally['skipped']} skipped, {tally['failed']} failed", flush=True)  # fmt: skip
            Path(args.results_out).write_text(
                json.dumps({"library": args.library, "outcomes": results}, indent=1) + "\n"
            )
    return 0


def estimate(record: dict, ours: dict, theirs: dict) -> dict:
    """The stratified ratio estimate (see the module docstring) of the share of DeepSpeed-passing
    in-scope tests that pass under deepspeed_cpp, with its standard error."""
    strata, covered, used = [], 0, 0
    for entry in record["files"].values():
        # The ids run under both libraries. A file's ids of one sample run (and are recorded)
        # together, so in a combined sample whose later part has not reached a file yet, the
        # earlier sample's ids are still a simple random sample of that file.
        ids = [i for i in entry["ids"] if i in ours and i in theirs]
        if not ids:
            continue  # a file not (yet) run under both libraries is left out of the estimate
        covered += entry["collected"]
        used += len(ids)
        x = [1.0 if theirs[i][0] == "passed" else 0.0 for i in ids]
        y = [1.0 if theirs[i][0] == "passed" and ours[i][0] == "passed" else 0.0 for i in ids]
        strata.append((entry["collected"], x, y))
    big_x = sum(n * sum(x) / len(x) for n, x, _ in strata)
    big_y = sum(n * sum(y) / len(y) for n, _, y in strata)
    if big_x == 0:
        return {"ratio": float("nan"), "se": float("nan"), "x": 0.0, "y": 0.0,
                "files": len(strata), "covered": covered, "ids": used}  # fmt: skip
    ratio = big_y / big_x
    variance = 0.0
    for n, x, y in strata:
        k = len(x)
        if k < 2:
            continue  # one sampled test: no within-file variance to estimate
        e = [yi - ratio * xi for xi, yi in zip(x, y)]
        mean = sum(e) / k
        s2 = sum((ei - mean) ** 2 for ei in e) / (k - 1)
        variance += n * n * (1 - k / n) * s2 / k
    return {"ratio": ratio, "se": math.sqrt(variance) / big_x, "x": big_x, "y": big_y,
            "files": len(strata), "covered": covered, "ids": used}  # fmt: skip


def report(args) -> int:
    record = combine_samples(args.ids)
    by_library = {}
    for path in args.results:
        loaded = json.loads(Path(path).read_text())
        # Several files of one library merge (runs split over the file list, reruns later).
        by_library.setdefault(loaded["library"], {}).update(loaded["outcomes"])
    libraries = [lib for lib in LIBRARIES if lib in by_library]
    print(f"DeepSpeed tests commit {record['commit']}, seed {record['seed']}, "
          f"{record['per_file']} per file\n")  # fmt: skip
    print("file".ljust(60) + " | in-scope" + "".join(f" | {lib:^23}" for lib in libraries))
    print(" " * 60 + " | coll    " + " | samp pass skip fail    " * len(libraries))
    totals = {lib: collections.Counter() for lib in libraries}
    for path, entry in record["files"].items():
        cells = []
        for lib in libraries:
            tally = collections.Counter(
                by_library[lib].get(i, ["not run"])[0] for i in entry["ids"]
            )
            tally["sampled"] = len(entry["ids"])
            totals[lib].update(tally)
            cells.append(f" | {tally['sampled']:>4} {tally['passed']:>4} {tally['skipped']:>4} "
                         f"{tally['failed']:>4}    ")  # fmt: skip
        print(path[-60:].ljust(60) + f" | {entry['collected']:>8}" + "".join(cells))
    collected = sum(e["collected"] for e in record["files"].values())
    print("total".ljust(60) + f" | {collected:>8}" + "".join(
        f" | {t['sampled']:>4} {t['passed']:>4} {t['skipped']:>4} {t['failed']:>4}    "
        for t in totals.values()))  # fmt: skip
    for lib in libraries:
        grouped = collections.Counter(
            reason for nodeid, (outcome, reason) in by_library[lib].items() if outcome == "failed"
        )
        print(f"\nfailure reasons, {lib}:")
        for reason, count in grouped.most_common(60):
            print(f"  {count:>5}  {reason}")
    if set(LIBRARIES) <= set(libraries):
        ours, theirs = by_library["deepspeed_cpp"], by_library["DeepSpeed"]
        lost = [i for e in record["files"].values() for i in e["ids"]
                if theirs.get(i, ["not run"])[0] == "passed"
                and ours.get(i, ["not run"])[0] != "passed"]  # fmt: skip
        print(f"\npassing under DeepSpeed, not under deepspeed_cpp ({len(lost)}):")
        for nodeid in lost:
            outcome, reason = ours.get(nodeid, ["not run", ""])
            print(f"  {nodeid}  [{outcome}: {reason}]")
        figures = estimate(record, ours, theirs)
        files = sum(1 for e in record["files"].values() if e["ids"])
        sampled = sum(len(e["ids"]) for e in record["files"].values())
        print(f"\nestimate over the {figures['files']} of {files} sampled files run under both "
              f"libraries ({figures['covered']} of {collected} in-scope tests; "
              f"{figures['ids']} of {sampled} sampled ids):")  # fmt: skip
        print(f"estimated tests passing under DeepSpeed: {figures['x']:.0f}; under both: "
              f"{figures['y']:.0f}")  # fmt: skip
        share, error = 100 * figures["ratio"], 100 * figures["se"]
        print(f"estimated share of DeepSpeed-passing tests that pass under deepspeed_cpp: "
              f"{share:.1f}% (standard error {error:.1f} points)")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pick = commands.add_parser("sample", help="collect under DeepSpeed, pick ids per file")
    pick.add_argument("--tests", type=Path, required=True, help="DeepSpeed's tests/ folder")
    pick.add_argument("--deepspeed-python", required=True, help="a Python with real DeepSpeed")
    pick.add_argument("--per-file", type=int, default=2, help="ids sampled per file (K)")
    pick.add_argument("--seed", type=int, required=True)
    pick.add_argument("--ids-out", required=True, help="JSON file for the sampled ids")
    pick.add_argument("--files", nargs="*", help="these files instead of the in-scope list")
    pick.add_argument("--commit", help="DeepSpeed commit of --tests when it is not a git folder")
    pick.add_argument("--timeout", type=float, default=1800.0, help="seconds for collection")
    pick.add_argument(
        "--exclude",
        nargs="*",
        default=[],
        help="ids files of earlier samples: their ids are not drawn again",
    )
    execute = commands.add_parser("run", help="run the sampled ids under one library")
    execute.add_argument("--tests", type=Path, required=True, help="DeepSpeed's tests/ folder")
    execute.add_argument("--ids", required=True, help="the JSON file `sample` wrote")
    execute.add_argument("--library", choices=LIBRARIES, required=True)
    execute.add_argument("--deepspeed-python", help="a Python with real DeepSpeed")
    execute.add_argument("--alias-path", nargs="*", default=(),
                         help="the alias run's PYTHONPATH extras (hjson, py-cpuinfo)")  # fmt: skip
    execute.add_argument("--results-out", required=True, help="JSON file for the outcomes")
    execute.add_argument("--only-failed", help="rerun only ids not passed in this results file")
    execute.add_argument("--timeout", type=float, default=1800.0, help="seconds per file")
    execute.add_argument("--resume", action="store_true",
                         help="skip ids --results-out already holds")  # fmt: skip
    summarize = commands.add_parser("report", help="tables, reasons and the estimate")
    summarize.add_argument("--ids", nargs="+", required=True,
                           help="the JSON file(s) `sample` wrote; several combine into one "
                           "sample (per file the union of their ids)")  # fmt: skip
    summarize.add_argument("--results", nargs="+", required=True,
                           help="`run` outputs; a later file wins per id")  # fmt: skip
    args = parser.parse_args(argv)
    return {"sample": sample, "run": run, "report": report}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
