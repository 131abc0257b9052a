"""The layers of ../shared/design/architecture.md, checked on the source: imports point down.

- ``deepspeed_cpp/ops`` (loader + typed wrappers over csrc) imports neither ``comm`` nor
  ``runtime``: what wraps an op for logging or policy lives above it;
- ``runtime/checkpoint`` sees a ZeRO stage only through plain data (``layout_parts()``, a
  ``TrainState``, a ``CheckpointSubject``): it imports no stage class and not the engine.

Relative imports are resolved, and imports inside functions count as well."""

from __future__ import annotations

import ast
from pathlib import Path

import deepspeed_cpp

PACKAGE = Path(deepspeed_cpp.__file__).parent

STAGE_MODULES = {
    "deepspeed_cpp.runtime.zero.build",
    "deepspeed_cpp.runtime.zero.moe_stage",
    "deepspeed_cpp.runtime.zero.partitioned_optimizer",
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


def test_the_check_resolves_relative_imports():
    """The checks above can fail: this file's own resolution finds a known downward import."""
    saver = PACKAGE / "runtime" / "checkpoint" / "saver.py"
    assert "deepspeed_cpp.runtime.checkpoint.expert_layout" in _imports(saver)
    moe_stage = PACKAGE / "runtime" / "zero" / "moe_stage.py"
    assert "deepspeed_cpp.runtime.zero.partitioned_optimizer" in _imports(moe_stage)
