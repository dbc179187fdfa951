"""The import order of docs/ARCHITECTURE.md, checked on the source: the leaves import nothing
of lmfuse, no family imports the rooms above the families (the sharded decode, serving,
the integrations, the command line), and every import between the package's rooms points
down the whole order (no cycle). Every import statement counts, function-level ones too
(a lazy import is still a dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import lmfuse

ROOT = Path(lmfuse.__file__).parent
FAMILIES = ("softmax", "norm", "rope", "activations", "cross_entropy", "attention", "moe")
ABOVE_FAMILIES = ("distributed", "serving", "integrations", "megatron", "cli", "demo",
                  "generate_cli", "bench", "tiny_gpt")
LEAVES = ("_launch.py", "_fp8.py", "_softcap.py", "_collectives.py", "_pdl_kernels.py")
# docs/ARCHITECTURE.md's order, a rank per room: a room imports only rooms of lower rank.
# "" is the package itself (lmfuse/__init__.py); integrations/megatron_core.py is
# lmfuse.megatron's patch and counts as that room.
RANKS = {
    "_launch": 0, "_fp8": 0, "_softcap": 0, "_collectives": 0, "_pdl_kernels": 0,
    "_cli_args": 1, "_dispatch": 1, "tuning": 1, "_nvtx": 1, "_pdl": 1.5, "_check": 1.5,
    "softmax": 2, "norm": 2, "rope": 2, "activations": 2, "cross_entropy": 2,
    "attention": 3, "moe": 3,
    "distributed": 4,
    "": 5, "integrations": 5,
    "megatron": 6, "serving": 6,
    "bench": 7, "tiny_gpt": 7,
    "demo": 8, "generate_cli": 8,
    "cli": 9,
    "__main__": 10,
}


def room(dotted: str) -> str:
    """The room of a module named below ``lmfuse`` (``"integrations.megatron_core"``)."""
    return "megatron" if dotted.startswith("integrations.megatron_core") else \
        dotted.split(".")[0]


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


def test_every_room_imports_only_rooms_below_it() -> None:
    paths = sorted(ROOT.rglob("*.py"))
    rooms = set()
    wrong = []
    for path in paths:
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        here = room(".".join(parts))
        rooms.add(here)
        for name in lmfuse_imports(path):
            there = room(name)
            if there != here and RANKS[there] >= RANKS[here]:
                wrong.append(f"{path.relative_to(ROOT)} ({here}) imports lmfuse.{name} "
                             f"({there})")
    assert rooms <= set(RANKS), f"rooms with no place in the order: {rooms - set(RANKS)}"
    assert not wrong, "\n".join(wrong)


def test_no_private_names_across_rooms() -> None:
    """A room takes another room's public names only (``from ..attention.ops import
    _resolve`` would tie it to that module's internals); the leaves' helpers count as
    public whatever their module's name."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        here = room(".".join(parts))
        package = path.relative_to(ROOT).parent.parts
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module:
                continue
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join((*base, *node.module.split(".")))
            elif node.module.startswith("lmfuse."):
                name = node.module[len("lmfuse."):]
            else:
                continue
            if room(name) == here:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private:
                wrong.append(f"{path.relative_to(ROOT)} takes {private} from lmfuse.{name}")
    assert not wrong, "\n".join(wrong)
