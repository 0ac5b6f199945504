"""What the app and the metrics command load at start, and a clean exit when the server stops while the prefetch
is importing the drift lab (torch)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_the_app_start_path_does_not_import_torch():
    """The pages' shared modules load without torch (over a second of import): only a lab run, a DriftLogger or
    a tensor file needs it. A run-name helper living in the torch-importing logger once put torch on every app
    start (analysis/run_names.py now holds it)."""
    out = run_python("""
        import sys
        sys.path.insert(0, '.')
        import ui.prefetch, ui.sidebar, ui.charts, analysis.metrics.dashboard, analysis.findings.ranking, analysis.ingest
        assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('analysis'))
        """)
    assert out.returncode == 0, out.stderr[-2000:]


def test_the_metrics_command_imports_only_what_it_uses(tmp_path):
    """`python -m analysis metrics` is a whole process per call: no torch, no streamlit, no plotly."""
    from analysis.store import Store
    Store(tmp_path / "empty.duckdb").close()
    out = run_python(f"""
        import sys
        sys.path.insert(0, '.')
        from analysis.__main__ import main
        assert main(['metrics', '--by', 'run', '--db', {str(tmp_path / 'empty.duckdb')!r}]) == 0
        heavy = [m for m in ('torch', 'streamlit', 'plotly', 'pandas', 'scipy') if m in sys.modules]
        assert not heavy, heavy
        """)
    assert out.returncode == 0, out.stderr[-2000:]


@pytest.mark.slow
def test_exit_while_the_lab_import_runs_is_clean(tmp_path):
    """The prefetch worker imports the drift lab (torch, seconds) after the other views. When the process exits
    during that import (SIGTERM to the server: the main thread returns), the import must complete before the
    exit handlers run; completed inside them, what torch registers for exit never runs and its weakref
    finalizers print "Exception ignored ... Traceback" at teardown (tests/test_shutdown.py saw it 4 runs in 5).
    Here the main thread returns as soon as torch starts loading in the worker."""
    out = run_python(f"""
        import os, sys, time, types
        sys.path.insert(0, '.')
        os.environ.pop('DRIFT_READ_ONLY', None)
        from ui import prefetch
        assert 'torch' not in sys.modules
        prefetch.GRACE_S = 0.0
        store = types.SimpleNamespace(path={str(tmp_path / 'x.duckdb')!r}, closing=False)
        app = types.SimpleNamespace(store=store, version=1)
        prefetch._worker.submit(app, 1, [])  # no views to compute: straight to the lab import
        prefetch.page_done()
        deadline = time.monotonic() + 60
        while 'torch' not in sys.modules and time.monotonic() < deadline:
            time.sleep(0.005)
        assert 'torch' in sys.modules
        lab = sys.modules.get('analysis.lab.run')  # its body defines _run() last
        assert lab is None or not hasattr(lab, '_run')  # still importing: the main thread returns now
        print('exiting mid-import', flush=True)
        """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "exiting mid-import" in out.stdout
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
