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
