"""`python -m analysis warm` compiles every kernel with the argument types that ingest and DriftLogger pass: after
it, a DriftLogger step on the CPU and an ingest of token and routing files (summarised at ingest, routing of both
sides) compile nothing more. Each check runs in a fresh interpreter, where no earlier test compiled anything."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import pyarrow.parquet as pq
    sys.path[:0] = [sys.argv[1], str(Path(sys.argv[1]) / "tests")]
    from analysis.ingest import ingest_paths, routing_kernel as R
    from analysis.record.logger import DriftLogger
    from analysis.store import Store
    from analysis.summaries import kernel as K
    from analysis.ingest.warm import warm
    from helpers.logger import make_step

    kernels = [K.accumulate, R.set_masks, R.compare, R.count_experts]  # the entry points (helpers are linked in)
    def compiled():
        return {k.__name__: len(k.signatures) for k in kernels}
    out = Path(sys.argv[2])
    if sys.argv[3] == "warm":
        warm()
    after_warm = compiled()
    DriftLogger(out / "logged", "r").log_step(3, **make_step())  # the kernel in DriftLogger's grid form
    plain = out / "plain"  # the same rows without the summarised mark: ingest summarises them itself
    plain.mkdir()
    for kind in ("tokens", "routing"):
        f = out / "logged" / "r" / f"{kind}-step000003.parquet"
        pq.write_table(pq.read_table(f).replace_schema_metadata({}), plain / f.name)
    outcomes = ingest_paths(Store(out / "db.duckdb"), [plain])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    print(json.dumps({"after_warm": after_warm, "after_use": compiled()}))
""")


def _run(tmp_path: Path, mode: str) -> dict:
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(ROOT), str(tmp_path), mode], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_after_warm_a_logger_step_and_an_ingest_compile_nothing_more(tmp_path):
    got = _run(tmp_path, "warm")
    assert got["after_warm"] == {k: 1 for k in got["after_warm"]}, got  # one signature of each kernel
    assert got["after_use"] == got["after_warm"], got


@pytest.mark.slow
def test_without_warm_the_same_use_compiles_every_kernel(tmp_path):
    """The check above can fail: without the warm-up the same work is what compiles (or loads) each kernel."""
    got = _run(tmp_path, "none")
    assert got["after_warm"] == {k: 0 for k in got["after_warm"]}, got
    assert got["after_use"] == {k: 1 for k in got["after_use"]}, got


@pytest.mark.slow
def test_warm_command_exits_cleanly():
    done = subprocess.run([sys.executable, "-m", "analysis", "warm"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout == "", done.stderr[-2000:]


@pytest.mark.slow
def test_background_warm_starts_once_per_process_and_honours_the_switch(monkeypatch):
    import threading

    from analysis.ingest import warm
    monkeypatch.setattr(warm, "_started", threading.Event())
    monkeypatch.setenv("DRIFT_NO_WARM", "1")
    assert warm.start_in_background() is None
    monkeypatch.delenv("DRIFT_NO_WARM")
    child = warm.start_in_background()
    assert child is not None and child.wait(timeout=600) == 0
    assert warm.start_in_background() is None  # once per process


@pytest.mark.slow
def test_compiled_reads_the_cache_before_and_after_warm(tmp_path):
    """With an empty cache of its own (NUMBA_CACHE_DIR), compiled() is False; after `warm`, a new process finds
    every kernel there."""
    import os
    env = os.environ | {"NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    ask = [sys.executable, "-c", "from analysis.ingest.warm import compiled; print(compiled())"]

    def run(cmd):
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.strip()
    assert run(ask) == "False"
    run([sys.executable, "-m", "analysis", "warm"])
    assert run(ask) == "True"
