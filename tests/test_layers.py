"""The import order of docs/ARCHITECTURE.md, checked on the source: the leaves import nothing
of lmfuse, and no family imports the rooms above the families (the sharded decode, serving,
the integrations, the command line). Every import statement counts, function-level ones too
(a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lmfuse

ROOT = Path(lmfuse.__file__).parent
FAMILIES = ("softmax", "norm", "activations", "cross_entropy", "attention", "moe")
ABOVE_FAMILIES = ("distributed", "serving", "integrations", "megatron", "cli", "demo",
                  "generate_cli", "bench")
LEAVES = ("_launch.py", "_fp8.py", "_collectives.py")


def lmfuse_imports(path: Path) -> set[str]:
    """The lmfuse modules ``path`` imports, as dotted names below ``lmfuse``."""
    package = path.relative_to(ROOT).parent.parts
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name[len("lmfuse."):] for a in node.names
                      if a.name.startswith("lmfuse.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join((*base, *(node.module.split(".") if node.module else ())))
                found |= ({name} if node.module else {".".join((*base, a.name))
                                                      for a in node.names})
            elif (node.module or "").startswith("lmfuse"):
                found.add(node.module[len("lmfuse."):] if node.module != "lmfuse" else "")
    return found


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_nothing_of_lmfuse(leaf: str) -> None:
    assert lmfuse_imports(ROOT / leaf) == set()


@pytest.mark.parametrize("family", FAMILIES)
def test_families_import_nothing_above_them(family: str) -> None:
    for path in sorted((ROOT / family).rglob("*.py")):
        for name in lmfuse_imports(path):
            top = name.split(".")[0]
            assert top not in ABOVE_FAMILIES, (
                f"{path.relative_to(ROOT)} imports lmfuse.{name}, a room above the families")
