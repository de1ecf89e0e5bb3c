"""Layers import one way: every ``import`` under flowloop/ (module level or inside a function) is
checked against the layer table, so an upward edge fails here instead of in a review."""

from __future__ import annotations

import ast
from pathlib import Path

import flowloop

PACKAGE = Path(flowloop.__file__).resolve().parent

# Copied from /work/shared/DESIGN.md, section "Layers", column "may import" (flowloop packages only;
# the third-party names there are not checked). "rollout.client" means that module alone: agent
# loops reach the rollout through its client; its request and output types ride along with it.
MAY_IMPORT = {
    "protocol": set(),
    "config": {"protocol"},
    "models": set(),
    "sampling": set(),
    "rollout": {"models", "sampling", "protocol"},
    "agent_loop": {"rollout.client", "rollout.types", "reward.worker", "protocol"},
    "reward": {"protocol"},
    "trainer": {"protocol", "config", "models", "sampling", "rollout", "agent_loop", "reward"},
    "tasks": {"protocol", "reward"},
    "cli": {"*"},
}
# Not in the table: `plot` is the body of `flowloop plot`, so it sits with the cli; the helpers
# below are leaves (they import no flowloop package) that any layer may use.
SAME_AS = {"plot": "cli"}
UTILITIES = {"extras", "allocator", "compute", "visual"}

# Upward edges that exist today, each to be removed by moving code, not by adding here. The test
# also fails when one of them is gone, so this list only shrinks.
KNOWN_UPWARD = {
    ("agent_loop", "flowloop.config.rollout"),
    ("agent_loop", "flowloop.models.base"),
    ("agent_loop", "flowloop.models.prompt_ids"),
    ("agent_loop", "flowloop.rollout.engine"),
    ("agent_loop", "flowloop.rollout.server"),
    ("config", "flowloop.trainer.advantages"),
    ("config", "flowloop.trainer.objectives"),
    ("reward", "flowloop.tasks"),
    ("trainer", "flowloop.tasks"),
    ("trainer", "flowloop.tasks.shapes.task"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every flowloop module ``path`` imports, anywhere in the file (lazy imports included)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module
            found.append((name, node.lineno))
    return [(name, line) for name, line in found if name == "flowloop" or name.startswith("flowloop.")]


def _layer(module: str) -> str:
    top = module.split(".")[1] if "." in module else ""
    return SAME_AS.get(top, top)


def _allowed(layer: str, target: str) -> bool:
    inner = target.removeprefix("flowloop.")
    if _layer(target) in (layer, "") or inner.split(".")[0] in UTILITIES or "*" in MAY_IMPORT[layer]:
        return True
    return any(inner == rule or inner.startswith(rule + ".") for rule in MAY_IMPORT[layer])


def _edges() -> dict[tuple[str, str], list[str]]:
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer(_module_name(path))
        for target, line in _imports(path):
            if not _allowed(layer, target):
                edges.setdefault((layer, target), []).append(f"{path.relative_to(PACKAGE.parent)}:{line}")
    return edges


def test_every_package_is_in_the_layer_table():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    unknown = tops - set(MAY_IMPORT) - set(SAME_AS) - UTILITIES - {"__init__"}
    assert not unknown, f"{sorted(unknown)} are in no layer: add them to DESIGN.md's table and to MAY_IMPORT"


def test_utilities_import_no_flowloop_package():
    for name in UTILITIES:
        assert _imports(PACKAGE / f"{name}.py") == [], f"flowloop/{name}.py is a utility: it may import no flowloop package"


def test_no_upward_imports():
    edges = _edges()
    new = {edge: where for edge, where in edges.items() if edge not in KNOWN_UPWARD}
    assert not new, "imports against the layer table (DESIGN.md, Layers):\n" + "\n".join(
        f"  {layer} -> {target}: {', '.join(where)}" for (layer, target), where in sorted(new.items()))
    gone = KNOWN_UPWARD - set(edges)
    assert not gone, f"no longer imported, remove from KNOWN_UPWARD: {sorted(gone)}"
