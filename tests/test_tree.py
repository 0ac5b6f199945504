"""The source tree's own rules, read with `ast`: what every page does first, and which modules import which."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_page_routes_through_app_before_drawing():
    """The pages/ folder's own routing would run a page without app.py's sign-in gate: each page's first
    statement after its imports is the explicit guard (no module does it as an import side effect)."""
    pages = sorted((ROOT / "pages").glob("*.py"))
    assert len(pages) >= 7
    for page in pages:
        body = [n for n in ast.parse(page.read_text()).body
                if not isinstance(n, (ast.Import, ast.ImportFrom)) and not (
                    isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]  # docstring
        first = ast.unparse(body[0])
        assert first == "auth.ensure_routed_through_app()", (page.name, first)
    access = ast.parse((ROOT / "ui" / "access.py").read_text())
    assert not any(isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) for n in access.body)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: str = "analysis") -> dict[str, set[str]]:
    """{module: modules of `package` it imports}, counting imports inside functions too (a lazy import still
    ties the two modules together). `from a.b import c` is an edge to a.b.c when c is a module, else to a.b;
    a parent package's own __init__ is not counted as imported by its submodules."""
    files = {module_name(p): p for p in (ROOT / package).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        is_pkg = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: from the module's own package
                    base = mod.split(".")[: len(mod.split(".")) - node.level + is_pkg]
                    stem = ".".join(base + ([node.module] if node.module else []))
                else:
                    stem = node.module
                targets = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in files else stem for a in node.names]
            else:
                continue
            edges.update(t for t in targets if t in files and t != mod)
        graph[mod] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_on_small_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"d2"}, "d2": {"d"}}) == ["d", "d2", "d"]


def test_the_import_graph_sees_lazy_imports():
    graph = import_graph()
    assert "analysis.ingest.tensors" in graph["analysis.ingest.load"]
    assert "analysis.lab.cli" in graph["analysis.__main__"]  # imported inside main()


def test_no_import_cycle_in_analysis():
    assert find_cycle(import_graph()) is None
