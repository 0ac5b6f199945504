"""The database file synced while a large file loads (analysis/ingest/writeback.py): through DuckDB's own
descriptors, found in /proc/self/fd, and without ever closing one, since closing any descriptor of a file drops
the process's POSIX locks on it, DuckDB's write lock among them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from analysis.ingest import batches, ingest_paths, load, writeback
from analysis.store import Store

from helpers.data import metrics_make_tokens

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc (Linux)")


def other_process_can_open(db) -> bool:
    """Whether another process can open the database for writing (it cannot while this one holds DuckDB's lock)."""
    code = textwrap.dedent(f"""
        import duckdb
        try:
            duckdb.connect({str(db)!r}).close()
        except duckdb.IOException as e:
            assert 'lock' in str(e), e
            raise SystemExit(3)
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode in (0, 3), out.stderr[-2000:]
    return out.returncode == 0


@pytest.mark.slow  # another process tries the database's lock
def test_it_syncs_duckdbs_descriptor_and_keeps_the_databases_lock(tmp_path):
    db = tmp_path / "db.duckdb"
    store = Store(db)
    fds = writeback._descriptors(db)
    assert fds and all(os.readlink(f"/proc/self/fd/{fd}") == str(db.resolve()) for fd in fds)
    with writeback.Writeback(db, interval=0.01) as wb:
        with store.transaction() as w:
            w.execute("CREATE TABLE t AS SELECT range AS i FROM range(3000000)")
        deadline = time.monotonic() + 5
        while wb.syncs < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert wb.syncs >= 3
    assert writeback._descriptors(db) == fds  # none closed
    assert not other_process_can_open(db)  # DuckDB's lock is still held
    store.close()
    assert other_process_can_open(db)  # and only now let go


def test_a_file_no_one_has_open_gets_no_thread(tmp_path):
    (tmp_path / "x.duckdb").write_bytes(b"")
    with writeback.Writeback(tmp_path / "x.duckdb", interval=0.01) as wb:
        assert wb._thread is None
    assert wb.syncs == 0


@pytest.mark.slow
def test_a_large_load_syncs_while_it_runs_and_the_lock_stays(tmp_path, monkeypatch):
    """A file above ALONE_BYTES (lowered here) loads inside a Writeback; the database keeps its lock after."""
    monkeypatch.setattr(batches, "ALONE_BYTES", 4096)
    monkeypatch.setattr(load, "ALONE_BYTES", 4096)
    used = []
    real = writeback.Writeback

    class Spy(real):
        def __exit__(self, *exc):
            used.append(self._thread is not None)
            return super().__exit__(*exc)
    monkeypatch.setattr(load, "Writeback", Spy)
    f = tmp_path / "a.parquet"
    metrics_make_tokens(seed=1, runs=("w",), steps=(0, 1), n_seq=6, optional=False).write_parquet(f)
    db = tmp_path / "db.duckdb"
    store = Store(db)
    assert [o.status for o in ingest_paths(store, [f])] == ["loaded"]
    assert used == [True]
    assert not other_process_can_open(db)
    store.close()
