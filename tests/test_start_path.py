"""What the app and the metrics command load at start (the pages themselves, prefetch included:
tests/test_lean_start.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

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
        # nor numba (~70 MB, ~0.2 s): the live-folder status and a writable database's opening load the ingest
        # stack only when a folder is followed or a file needs summarising
        import ui.live, analysis.ingest.summarise
        assert 'numba' not in sys.modules, sorted(m for m in sys.modules if m.startswith('analysis'))
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
