"""A loading process leaves pandas, scipy and OpenBLAS's thread pool out of its start (analysis/ingest/lean.py),
and loads files as before without them; the app opens every page but the Lab, and prefetches every default view,
without importing torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from analysis.ingest import lean

from helpers.apptest import PAGES
from helpers.ingest import make_logs

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(ROOT)})


def test_a_process_that_imported_numpy_is_left_as_it_is():
    assert "numpy" in sys.modules
    assert lean.lean_start() is False
    assert not any(isinstance(f, lean._Refuse) for f in sys.meta_path)


def test_lean_start_refuses_pandas_and_scipy_with_a_message_and_keeps_blas_to_one_thread():
    out = _python("""
        import os, sys
        from analysis.ingest.lean import lean_start
        assert lean_start() is True and lean_start() is False
        assert os.environ["OPENBLAS_NUM_THREADS"] == "1"
        for name in ("pandas", "scipy.linalg"):
            try:
                __import__(name)
            except ModuleNotFoundError as e:
                print(name, "refused:", e)
        import numpy, pyarrow
        print("array", pyarrow.array(numpy.arange(3)).to_pylist())
    """)
    assert out.returncode == 0, out.stderr
    assert "pandas refused: pandas is not imported by a Driftscope load" in out.stdout
    assert "scipy.linalg refused: scipy is not imported by a Driftscope load" in out.stdout  # its package first
    assert "array [0, 1, 2]" in out.stdout


def test_lean_start_keeps_arrow_buffers_off_huge_pages_unless_told_otherwise():
    out = _python("""
        import os
        from analysis.ingest.lean import lean_start
        lean_start()
        import pyarrow
        print("thp", os.environ["MIMALLOC_ALLOW_THP"], pyarrow.default_memory_pool().backend_name)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("thp 0 "), out.stdout
    kept = subprocess.run([sys.executable, "-c", "import os; from analysis.ingest.lean import lean_start; "
                           "lean_start(); print(os.environ['MIMALLOC_ALLOW_THP'])"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "MIMALLOC_ALLOW_THP": "1"})
    assert kept.stdout.strip() == "1", kept.stdout + kept.stderr  # a user's own setting stays


def test_the_ingest_command_loads_tokens_and_routing_without_pandas_scipy_or_polars(tmp_path):
    tokens, rows = make_logs(seed=3, steps=2, samples=3, length=20, layers=4, k=2)
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "routing.parquet")
    db = tmp_path / "d.duckdb"
    out = _python(f"""
        import sys
        from analysis.__main__ import main
        rc = main(["ingest", {str(tmp_path / "tokens.parquet")!r}, {str(tmp_path / "routing.parquet")!r},
                   "--db", {str(db)!r}])
        print("rc", rc, *(name in sys.modules for name in ("pandas", "scipy", "polars")))
    """)
    assert out.returncode == 0, out.stderr
    # polars: imported where a result is read (store.py), which a load never does
    assert "rc 0 False False False" in out.stdout, out.stdout + out.stderr
    import duckdb
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT count(*) FROM tokens").fetchall()[0][0] == len(tokens["run"])
    assert con.execute("SELECT count(*) FROM routing").fetchall()[0][0] == len(rows)
    con.close()


def test_no_page_but_the_lab_imports_torch_nor_does_the_prefetch(tmp_path):
    """Each page except the Lab opened in one session (AppTest, the app's own script), then the prefetch of every
    page's default view run to its end: torch (~1.3 s of a core, ~300 MB) stays out of the server. The Lab page
    imports it when a run starts."""
    from helpers.browser import build_fixture_db

    db = tmp_path / "pages.duckdb"
    build_fixture_db(db, tmp_path / "logs")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = ['.', 'tests']
        os.environ.update(DRIFT_DB={str(db)!r}, DRIFT_NO_DEMO='1', DRIFT_PREFETCH='1', DRIFT_NO_WARM='1')
        from streamlit.testing.v1 import AppTest, app_test
        from helpers.apptest import PAGES, NavigationOnly
        app_test.PagesManager = NavigationOnly
        at = AppTest.from_file('app.py', default_timeout=120)
        at.run()
        for page in PAGES:
            if page == 'pages/lab.py':
                continue
            at.switch_page(page).run()
            assert not at.exception, (page, at.exception)
            print(page, 'torch' in sys.modules, flush=True)
        from ui import prefetch
        assert prefetch.wait_idle(240), 'the prefetch did not finish'
        print('after prefetch', 'torch' in sys.modules, flush=True)
    """)], cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("pages/", "after prefetch"))]
    assert len(lines) == len(PAGES), out.stdout  # every page but the Lab, then the prefetch
    assert all(ln.endswith(" False") for ln in lines), lines
