"""The layers of ../shared/design/architecture.md, checked on the source: imports point down.

- ``deepspeed_cpp/ops`` (loader + typed wrappers over csrc) imports neither ``comm`` nor
  ``runtime``: what wraps an op for logging or policy lives above it;
- ``runtime/checkpoint`` sees a ZeRO stage only through plain data (``layout_parts()``, a
  ``TrainState``, a ``CheckpointSubject``): it imports no stage class and not the engine;
  pipeline checkpoints (``runtime/pipe/checkpoint.py``, ``optimizer_reshard.py``) see the engine
  only as a ``PipeCheckpointSubject``: no name ``engine`` in them, no engine import;
- ZeRO stages are composed, not inherited: no class in ``runtime/zero`` has more than one
  deepspeed_cpp base class, and the pieces a stage is composed of (its ``ShardSet``, steppers,
  checkpoint view, fragments, gathers) read no private attribute of another object;
- a stage's ``ShardSet``, bucket plan and C++ reducer are built in one place
  (``shard_set_builder.py``, with ZeRO-3's layout in ``partitioned_buckets.py``), and no class
  subclasses ``ZeroPartitionedOptimizer`` to build them differently.

Relative imports are resolved, and imports inside functions count as well."""

from __future__ import annotations

import ast
from pathlib import Path

import deepspeed_cpp

PACKAGE = Path(deepspeed_cpp.__file__).parent

STAGE_MODULES = {
    "deepspeed_cpp.runtime.zero.build",
    "deepspeed_cpp.runtime.zero.moe_stage",
    "deepspeed_cpp.runtime.zero.partitioned_buckets",
    "deepspeed_cpp.runtime.zero.partitioned_optimizer",
    "deepspeed_cpp.runtime.zero.shard_set_builder",
    "deepspeed_cpp.runtime.zero.stage3",
    "deepspeed_cpp.runtime.zero.stage_1_and_2",
    "deepspeed_cpp.runtime.engine",
}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (``from x import y`` counts as ``x`` and ``x.y``)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = (
        module.rsplit(".", 1)[0] if path.name != "__init__.py" else module[: -len(".__init__")]
    )
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{anchor}.{base}" if base else anchor
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _offenders(folder: str, forbidden) -> list[tuple[str, str]]:
    return [
        (str(path.relative_to(PACKAGE)), name)
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for name in sorted(_imports(path))
        if forbidden(name)
    ]


def test_ops_import_neither_comm_nor_runtime():
    def above_ops(name: str) -> bool:
        return name.startswith(("deepspeed_cpp.comm", "deepspeed_cpp.runtime"))

    assert _offenders("ops", above_ops) == []


def test_checkpoints_see_no_stage_class_and_no_engine():
    assert _offenders("runtime/checkpoint", STAGE_MODULES.__contains__) == []


def _project_bases(source: str, module: str) -> dict[str, list[str]]:
    """Per class defined in ``source`` (module ``module``), its bases that are deepspeed_cpp
    classes: defined in the same source or imported from a deepspeed_cpp module."""
    tree = ast.parse(source)
    package = module.rsplit(".", 1)[0]
    project = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("deepspeed_cpp"):
                project.update(alias.asname or alias.name for alias in node.names)
    return {
        node.name: [ast.unparse(b) for b in node.bases if ast.unparse(b) in project]
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def test_zero_classes_have_one_project_base_at_most():
    many = {
        f"{path.relative_to(PACKAGE)}::{name}": bases
        for path in sorted((PACKAGE / "runtime" / "zero").rglob("*.py"))
        for name, bases in _project_bases(
            path.read_text(encoding="utf-8"), _module_name(path)
        ).items()
        if len(bases) > 1
    }
    assert many == {}


def test_the_base_check_can_fail():
    source = (
        "import torch\nfrom .steppers import InMemoryStepper\nfrom .shard_set import ShardSet\n"
        "class Local: pass\n"
        "class Tower(InMemoryStepper, ShardSet, torch.nn.Module): pass\n"
        "class Fine(Local, torch.nn.Module): pass\n"
    )
    found = _project_bases(source, "deepspeed_cpp.runtime.zero.example")
    assert found["Tower"] == ["InMemoryStepper", "ShardSet"]
    assert found["Fine"] == ["Local"]


# The pieces a ZeRO stage is composed of, and what composes them.
COMPOSED = [
    "runtime/zero/build.py",
    "runtime/zero/in_place_grads.py",
    "runtime/zero/moe_stage.py",
    "runtime/zero/offload/stepping.py",
    "runtime/zero/param_fragments.py",
    "runtime/zero/param_gathers.py",
    "runtime/zero/partitioned_buckets.py",
    "runtime/zero/partitioned_optimizer.py",
    "runtime/zero/shard_checkpoint_state.py",
    "runtime/zero/shard_norms.py",
    "runtime/zero/shard_set.py",
    "runtime/zero/shard_set_builder.py",
    "runtime/zero/steppers.py",
]


def _private_reads(source: str) -> list[str]:
    """``x._name`` where ``x`` is neither ``self``, ``cls``, ``super()`` nor a name an import
    binds (a module's private helpers, e.g. ``torch._foreach_norm``, are not another object's
    state)."""
    tree = ast.parse(source)
    imported = {"self", "cls"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            imported.update((a.asname or a.name).split(".")[0] for a in node.names)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
            continue
        if node.attr.startswith("__"):
            continue
        owner = node.value
        if isinstance(owner, ast.Name) and owner.id in imported:
            continue
        if isinstance(owner, ast.Call) and ast.unparse(owner.func) == "super":
            continue
        found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_stage_pieces_read_no_private_attribute_of_another_object():
    found = {
        name: reads
        for name in COMPOSED
        if (reads := _private_reads((PACKAGE / name).read_text(encoding="utf-8")))
    }
    assert found == {}
    sample = (
        "import torch\nclass A:\n    def f(self, stage):\n        return stage._steps, self._x\n"
    )
    assert _private_reads(sample) == ["4: stage._steps"]  # the check can fail


# Where each construction call of a stage's storage may appear (runtime/zero, relative paths).
BUILT_ONLY_IN = {
    "ShardSet": {"shard_set_builder.py"},
    "make_gradient_reducer": {"shard_set_builder.py"},
    "plan_buckets": {"shard_set_builder.py", "partitioned_buckets.py"},
}


def _construction_calls(source: str) -> set[str]:
    """The names of ``BUILT_ONLY_IN`` that ``source`` calls, and ``subclass`` where a class
    derives from ``ZeroPartitionedOptimizer`` (a stage kind built by overriding its
    construction)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            if name in BUILT_ONLY_IN:
                found.add(name)
        elif isinstance(node, ast.ClassDef):
            bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
            if "ZeroPartitionedOptimizer" in bases:
                found.add("subclass")
    return found


def test_shard_sets_are_built_in_one_place():
    zero = PACKAGE / "runtime" / "zero"
    misplaced = sorted(
        (str(path.relative_to(zero)), name)
        for path in zero.rglob("*.py")
        for name in _construction_calls(path.read_text(encoding="utf-8"))
        if str(path.relative_to(zero)) not in BUILT_ONLY_IN.get(name, set())
    )
    assert misplaced == []
    sample = (
        "from .ops import zero\nclass Stage3(ZeroPartitionedOptimizer):\n"
        "    def _make_reducer(self):\n        return zero.make_gradient_reducer(self.plan)\n"
    )
    assert _construction_calls(sample) == {"subclass", "make_gradient_reducer"}  # can fail


PIPE_CHECKPOINT = ["runtime/pipe/checkpoint.py", "runtime/pipe/optimizer_reshard.py"]


def test_pipeline_checkpoints_see_a_subject_not_the_engine():
    engines = {"deepspeed_cpp.runtime.engine", "deepspeed_cpp.runtime.pipe.engine"}
    names = {}
    for name in PIPE_CHECKPOINT:
        path = PACKAGE / name
        assert not engines & _imports(path), name
        tree = ast.parse(path.read_text(encoding="utf-8"))
        names[name] = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names[name] |= {n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)}
    assert [name for name in PIPE_CHECKPOINT if "engine" in names[name]] == []
    # The check sees the names it should: what the engine is seen as, and the stage it reshards.
    assert "subject" in names[PIPE_CHECKPOINT[0]] and "zero" in names[PIPE_CHECKPOINT[1]]


def test_the_check_resolves_relative_imports():
    """The checks above can fail: this file's own resolution finds a known downward import."""
    saver = PACKAGE / "runtime" / "checkpoint" / "saver.py"
    assert "deepspeed_cpp.runtime.checkpoint.expert_layout" in _imports(saver)
    moe_stage = PACKAGE / "runtime" / "zero" / "moe_stage.py"
    assert "deepspeed_cpp.runtime.zero.partitioned_optimizer" in _imports(moe_stage)
