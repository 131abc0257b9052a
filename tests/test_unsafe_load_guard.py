"""Loading never runs code: no unguarded unpickling anywhere in the package, and the one opt-in
(``allow_pickle``) round trip on a real engine.

The guard parses every Python file of the package (and the examples and benchmarks, which users
copy) and fails on a ``torch.load`` without ``weights_only=True``, on any ``pickle``-family load,
on ``numpy.load(allow_pickle=True)``, and on aliases that would hide one (``from torch import
load``, ``loader = torch.load``) — except in the allow-listed opt-in function.
"""

from __future__ import annotations

import ast
import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from checkpoint_training import build_engine, global_batches, train
from conftest import REPO_ROOT
from dist_pool import shared_pool

SCANNED = ["deepspeed_cpp", "examples", "benchmarks"]
# (file, function): the only places that may unpickle in full, each behind an explicit opt-in.
ALLOWED = {("deepspeed_cpp/runtime/checkpoint/client_state.py", "load_client_state")}
UNPICKLERS = {"load", "loads", "Unpickler"}
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "marshal"}


def _dotted(node) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def _keyword(call: ast.Call, name: str):
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    return None


def _is_true(node) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def unsafe_loads(source: str, file: str) -> list[tuple[str, int, str]]:
    """``(function, line, what)`` for every unguarded unpickling in ``source``."""
    tree = ast.parse(source, file)
    found = []

    def visit(node, function: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.ImportFrom):
            names = {alias.name for alias in node.names}
            if node.module in ("torch", "torch.serialization") and "load" in names:
                found.append((function, node.lineno, f"from {node.module} import load"))
            if node.module in PICKLE_MODULES and names & UNPICKLERS:
                found.append((function, node.lineno, f"from {node.module} import {names}"))
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            module, _, attribute = name.rpartition(".")
            if name in ("torch.load", "torch.serialization.load"):
                if not _is_true(_keyword(node, "weights_only")):
                    found.append((function, node.lineno, f"{name} without weights_only=True"))
            elif module.split(".")[-1] in PICKLE_MODULES and attribute in UNPICKLERS:
                found.append((function, node.lineno, name))
            elif name in ("numpy.load", "np.load") and _keyword(node, "allow_pickle") is not None:
                if not (isinstance(_keyword(node, "allow_pickle"), ast.Constant)
                        and _keyword(node, "allow_pickle").value is False):  # fmt: skip
                    found.append((function, node.lineno, f"{name}(allow_pickle=...)"))
        if isinstance(node, ast.Assign) and _dotted(node.value) in ("torch.load", "pickle.load"):
            found.append((function, node.lineno, f"alias of {_dotted(node.value)}"))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found


def test_the_guard_sees_unguarded_loads():
    source = (
        "import torch, pickle, numpy as np\n"
        "from pickle import loads\n"
        "def f(p):\n"
        "    torch.load(p)\n"
        "    torch.load(p, weights_only=False)\n"
        "    torch.load(p, weights_only=True)\n"
        "    pickle.load(open(p, 'rb'))\n"
        "    np.load(p, allow_pickle=True)\n"
        "    g = torch.load\n"
    )
    lines = [line for _, line, _ in unsafe_loads(source, "probe.py")]
    assert lines == [2, 4, 5, 7, 8, 9]


def test_no_unguarded_unpickling_in_the_package():
    offenders, allowed_seen = [], set()
    for folder in SCANNED:
        for path in sorted((REPO_ROOT / folder).rglob("*.py")):
            relative = path.relative_to(REPO_ROOT).as_posix()
            for function, line, what in unsafe_loads(path.read_text(encoding="utf-8"), relative):
                if (relative, function) in ALLOWED:
                    allowed_seen.add((relative, function))
                else:
                    offenders.append(f"{relative}:{line} in {function}: {what}")
    assert not offenders, (
        "loading must never run code: use weights_only=True (or JSON / safetensors), or add an "
        "explicit opt-in path to ALLOWED in this test:\n" + "\n".join(offenders)
    )
    assert allowed_seen == ALLOWED, f"stale ALLOWED entries: {ALLOWED - allowed_seen}"


def test_client_state_check_names_the_first_object_weights_only_refuses():
    from collections import Counter, OrderedDict, defaultdict

    from deepspeed_cpp.runtime.checkpoint.client_state import check_client_state

    plain = {"a": OrderedDict(b=[1, (2.5, "x")]), "c": Counter(k=2), "t": torch.ones(2)}
    assert check_client_state({**plain, "s": {1, 2}, "d": torch.float16}, False) is False
    refused = {"d": defaultdict(int), "f": frozenset([1]), "r": Fraction(1, 2)}
    for key, value in refused.items():
        with pytest.raises(ValueError, match=rf"client_state\['{key}'\] is a "):
            check_client_state({**plain, key: value}, allow_pickle=False)
        assert check_client_state({key: value}, allow_pickle=True) is True


# ---- the opt-in on a real engine ------------------------------------------------------------


@pytest.fixture
def pool():
    return shared_pool(1)


def pickle_job(directory: str, seed: int):
    from deepspeed_cpp.runtime.checkpoint import CheckpointSaveError, PickleNotAllowedError

    engine = build_engine(seed, 1, 1)
    train(engine, global_batches(seed, 1))
    results = {}
    objects = {"epoch": 2, "nested": [1, {"ratio": Fraction(1, 3)}]}
    try:
        engine.save_checkpoint(directory, tag="refused", client_state=objects)
        results["refused"] = "saved"
    except CheckpointSaveError as error:
        results["refused"] = str(error)
    results["refused_exists"] = (Path(directory) / "refused").exists()
    engine.save_checkpoint(directory, tag="opted_in", client_state=objects, allow_pickle=True)
    engine.save_checkpoint(directory, tag="plain", client_state={"epoch": 2}, allow_pickle=True)
    fresh = build_engine(seed + 1, 1, 1)
    try:
        fresh.load_checkpoint(directory, tag="opted_in")
        results["without_opt_in"] = "loaded"
    except PickleNotAllowedError as error:
        results["without_opt_in"] = str(error)
    results["untouched"] = fresh.global_steps
    results["with_opt_in"] = fresh.load_checkpoint(directory, tag="opted_in", allow_pickle=True)[1]
    results["plain"] = build_engine(seed, 1, 1).load_checkpoint(directory, tag="plain")[1]
    return results


def test_allow_pickle_is_an_explicit_opt_in_on_both_sides(pool, tmp_path):
    (results,) = pool.run(pickle_job, str(tmp_path), int(torch.randint(0, 2**30, (1,))))
    refused = results["refused"]
    assert "client_state['nested'][1]['ratio'] is a fractions.Fraction" in refused
    assert "save_checkpoint(..., allow_pickle=True)" in refused
    assert "load_checkpoint(..., allow_pickle=True)" in refused
    assert results["refused_exists"] is False
    meta = json.loads((tmp_path / "opted_in" / "checkpoint_meta.json").read_text())
    assert meta["client_state_needs_pickle"] is True
    plain_meta = json.loads((tmp_path / "plain" / "checkpoint_meta.json").read_text())
    assert plain_meta["client_state_needs_pickle"] is False
    without = results["without_opt_in"]
    assert str(tmp_path / "opted_in" / "client_state.pt") in without
    assert "load_checkpoint(..., allow_pickle=True)" in without and "can run code" in without
    assert results["untouched"] == 0  # refused before anything was applied
    assert results["with_opt_in"] == {"epoch": 2, "nested": [1, {"ratio": Fraction(1, 3)}]}
    assert results["plain"] == {"epoch": 2}
