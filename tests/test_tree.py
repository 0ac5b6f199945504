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


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages: tuple[str, ...] = ("analysis",), root: Path = ROOT) -> dict[str, set[str]]:
    """{module: modules of `packages` it imports}, counting imports inside functions too (a lazy import still
    ties the two modules together). `from a.b import c` is an edge to a.b.c when c is a module, else to a.b;
    a parent package's own __init__ is not counted as imported by its submodules."""
    files = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
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


# -- the layers ------------------------------------------------------------------------------------------
# A unit is what a reader sees in the tree: a package directly under analysis/ (ingest, summaries, metrics, ...)
# or a module directly under it (store.py, schema.py); in ui/, each module. A unit may import units of lower
# layers only: never one of its own layer (siblings stay independent) nor one above. Lazy imports count.
LAYERS = [
    {"analysis.schema", "analysis.run_names", "analysis.routing_rows", "analysis.settings",
     "analysis.writeback"},  # ground
    {"analysis.key_runs"},        # how a batch's keys run (run codes, key order)
    {"analysis.summaries"},       # pure: summary tables, their SQL, kernel, finalise
    {"analysis.migrations"},      # the database layout's migrations, run by the store
    {"analysis.store"},           # the one door to DuckDB
    {"analysis.metrics", "analysis.ingest"},          # read side | write side
    {"analysis.findings", "analysis.lake"},           # above the metrics | above ingest
    {"analysis.record"},          # the trainer side: writes what ingest and the lake read
    {"analysis.lab", "analysis.commands"},
    {"analysis.probe"},          # the drift-origin probe: runs lab and Hugging Face models, loads through ingest
    {"analysis.__main__", "analysis.logger", "analysis.capture"},   # the CLI; the old trainer import paths
]
UI_LAYERS = [  # above every analysis layer
    {"ui.access", "ui.auth", "ui.nav", "ui.number_format", "ui.pick_table", "ui.plot", "ui.sequence_view"},
    {"ui.glossary", "ui.live"},
    {"ui.charts", "ui.state"},
    {"ui.context_charts", "ui.findings_charts", "ui.routing_charts", "ui.load_charts", "ui.mapping_form",
     "ui.prefetch", "ui.probe_charts"},
    {"ui.sidebar"},
]
PURE = {"analysis.summaries": ("analysis.ingest", "analysis.store", "analysis.migrations", "analysis.metrics",
                               "analysis.findings", "analysis.record", "analysis.lake"),
        "analysis.metrics": ("analysis.ingest", "analysis.record", "analysis.lake", "analysis.findings")}


def unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between units: an edge where any module of one imports any module of the other."""
    units: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        units.setdefault(unit(mod), set()).update(unit(d) for d in deps if unit(d) != unit(mod))
    return units


def layer_of(u: str) -> int:
    for i, layer in enumerate(LAYERS + UI_LAYERS):
        if u in layer:
            return i
    raise AssertionError(f"{u} is on no layer: add it to tests/test_tree.py LAYERS (where it belongs)")


def layer_breaks(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a unit's own layer or one above (lower layer -> higher), as 'a -> b (via m -> n)'."""
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            a, b = unit(mod), unit(dep)
            if a != b and layer_of(b) >= layer_of(a):
                out.append(f"{a} -> {b} (via {mod} -> {dep})")
    return out


def pure_breaks(graph: dict[str, set[str]], root: Path = ROOT) -> list[str]:
    """Imports of the pure packages into the write side, and any use of the store's Writer by them."""
    out = []
    for mod, deps in sorted(graph.items()):
        banned = PURE.get(unit(mod), ())
        out += [f"{mod} -> {d}" for d in sorted(deps) if unit(d) in banned]
        if unit(mod) in PURE:
            path = root / (mod.replace(".", "/") + ".py")
            path = path if path.exists() else root / mod.replace(".", "/") / "__init__.py"
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module == "analysis.store" \
                        and any(a.name == "Writer" for a in node.names):
                    out.append(f"{mod} -> analysis.store.Writer")
    return out


def test_no_cycle_between_files_or_units_and_no_arrow_up():
    graph = import_graph(("analysis", "ui"))
    assert find_cycle(graph) is None
    assert find_cycle(unit_graph(graph)) is None
    assert layer_breaks(graph) == []
    assert pure_breaks(graph) == []


def test_the_layer_rule_fails_on_a_planted_cycle(tmp_path):
    """The same checks over a copy of the tree with one lazy import planted where it must not be: the pure
    summaries reaching up into ingest (which imports them) makes a cycle between units and an arrow up."""
    for pkg in ("analysis", "ui"):
        for p in (ROOT / pkg).rglob("*.py"):
            (tmp_path / p.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / p.relative_to(ROOT)).write_text(p.read_text())
    finalise = tmp_path / "analysis" / "summaries" / "finalise.py"
    finalise.write_text(finalise.read_text() + "\n\ndef _planted():\n    from analysis.ingest import summarise\n")
    graph = import_graph(("analysis", "ui"), root=tmp_path)
    units = unit_graph(graph)
    cycle = find_cycle(units)
    assert cycle is not None and "analysis.summaries" in cycle and "analysis.ingest" in cycle
    assert "analysis.summaries -> analysis.ingest (via analysis.summaries.finalise -> analysis.ingest.summarise)" \
        in layer_breaks(graph)
    assert pure_breaks(graph, tmp_path) == ["analysis.summaries.finalise -> analysis.ingest.summarise"]


# -- the tests' own imports ------------------------------------------------------------------------------
TESTS = ROOT / "tests"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (inside functions too), as written: `from a.b import c` gives a.b and a.b.c."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_modules_import_helpers_never_another_test_module_or_conftest():
    """What several test modules share lives in tests/helpers/; a test module importing another one (or
    conftest) would run that module's imports, and tie the two, for a helper. The helpers import no test either."""
    files = sorted(TESTS.glob("test_*.py")) + sorted((TESTS / "helpers").glob("*.py")) + [TESTS / "conftest.py"]
    assert len(files) > 60
    bad = {f.relative_to(ROOT).as_posix(): sorted(m for m in imported_modules(f) if names_a_test_module(m))
           for f in files}
    assert {f: m for f, m in bad.items() if m} == {}


def names_a_test_module(module: str) -> bool:
    """Whether an imported module is a test module or conftest, by itself or through the package (`tests.test_x`,
    `tests.conftest`), as written in an import."""
    parts = module.split(".")
    if parts[0] == "tests":
        parts = parts[1:]
    return bool(parts) and (parts[0].startswith("test_") or parts[0] == "conftest")


def test_the_import_check_sees_a_test_module_imported_inside_a_function(tmp_path):
    planted = tmp_path / "test_planted.py"
    planted.write_text("from helpers.data import metrics_load\n\ndef test_x():\n    from test_pages import PAGES\n"
                       "    import conftest\n")
    assert {"test_pages", "test_pages.PAGES", "conftest", "helpers.data"} <= imported_modules(planted)


def test_the_import_check_sees_a_test_module_imported_through_the_tests_package():
    assert names_a_test_module("tests.test_logger_summaries") and names_a_test_module("tests.conftest")
    assert names_a_test_module("test_pages.PAGES") and names_a_test_module("conftest")
    assert not names_a_test_module("helpers.logger") and not names_a_test_module("tests.helpers.data")
    assert not names_a_test_module("analysis.ingest.summary_stream")


def test_benchmark_scripts_share_code_through_the_harness_only():
    """A benchmark script imports benchmarks/harness.py and benchmarks/inputs/, never another script (which
    would run that script's imports and tie the two), and the test helpers only through the harness."""
    bench = ROOT / "benchmarks"
    scripts = {p.stem for p in bench.glob("*.py")} - {"harness"}
    files = sorted(bench.glob("*.py")) + sorted((bench / "inputs").glob("*.py"))
    bad = {f.relative_to(ROOT).as_posix(): sorted(m for m in imported_modules(f)
                                                  if m.split(".")[0] in scripts | {"helpers"} or "browser_util" in m)
           for f in files}
    assert {f: m for f, m in bad.items() if m} == {"benchmarks/harness.py": ["helpers", "helpers.browser"]}
