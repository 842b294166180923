"""Imports run one way: the mobius core, then topology/, partition/, scheduler/, and the app on top;
and no package's modules import each other in a circle (imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("mobius", "topology", "partition", "scheduler")
LAYERS = {"core": 0, "topology": 1, "partition": 2, "scheduler": 3, "app": 4}
APP = ("mobius.app", "mobius.cli", "mobius.commands", "mobius.__main__")  # __main__: `python -m mobius`


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(f.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = f
    return out


def layer(module: str) -> str:
    if module in (APP[1], APP[3]) or any(module == a or module.startswith(a + ".") for a in (APP[0], APP[2])):
        return "app"
    top = module.split(".")[0]
    return "core" if top == "mobius" else top


def imports_of(path: Path, module: str, known: dict[str, Path]) -> set[str]:
    """Project modules a file imports anywhere in it (function bodies and TYPE_CHECKING blocks too)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def graph() -> nx.DiGraph:
    known = _modules()
    g = nx.DiGraph()
    for module, path in known.items():
        g.add_node(module)
        for dep in imports_of(path, module, known):
            g.add_edge(module, dep)
    return g


def test_no_module_imports_a_layer_above_its_own() -> None:
    upward = [f"{a} ({layer(a)}) imports {b} ({layer(b)})" for a, b in graph().edges
              if LAYERS[layer(b)] > LAYERS[layer(a)]]
    assert not upward, "\n".join(upward)


def test_no_package_imports_itself_in_a_circle() -> None:
    g = graph()
    for pkg in PACKAGES:
        inner = g.subgraph([m for m in g if m.split(".")[0] == pkg])
        cycles = list(nx.simple_cycles(inner))
        assert not cycles, f"{pkg}: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_the_walker_sees_imports_inside_functions(tmp_path: Path) -> None:
    """The checker itself: an upward import hidden in a function body is found."""
    known = {"mobius.x": tmp_path / "x.py", "scheduler.pipeline_engine": tmp_path / "e.py"}
    known["mobius.x"].write_text("def f():\n    from scheduler.pipeline_engine import PipelineEngine\n")
    assert imports_of(known["mobius.x"], "mobius.x", known) == {"scheduler.pipeline_engine"}
    assert layer("mobius.x") == "core" and layer("mobius.app.run") == "app" and layer("mobius.cli") == "app"
