"""A large load has the kernel write the database file's pages as it goes (analysis/writeback.py), with a
descriptor of its own that must not drop DuckDB's lock on the file: closing any descriptor of a file releases
every POSIX lock the process holds on it, so the Store closes this one only after DuckDB."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis import writeback
from analysis.ingest import batches, ingest_paths, load
from analysis.store import Store

linux_only = pytest.mark.skipif(writeback._SYNC_FILE_RANGE is None, reason="sync_file_range is Linux's")


def another_process_can_write(db) -> bool:
    """Whether a second process may open the database for writing (DuckDB refuses while a process holds it)."""
    code = (f"import duckdb\ntry:\n    duckdb.connect({str(db)!r}).close()\n"
            "except duckdb.Error:\n    raise SystemExit(1)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def tokens_file(path, n=20_000, seq=50):
    rng = np.random.default_rng(3)
    s = -rng.exponential(1.0, n)
    pq.write_table(pa.table({"run": ["r"] * n, "step": np.repeat(np.arange(n // 1000), 1000),
                             "sample": np.arange(n) // seq, "pos": np.arange(n) % seq,
                             "sampler_logprob": s, "trainer_logprob": np.minimum(s + rng.normal(0, 0.01, n), 0)}),
                   path, row_group_size=2_000)
    return path


@linux_only
def test_a_large_load_writes_back_and_keeps_duckdbs_lock_until_the_store_closes(tmp_path, monkeypatch):
    monkeypatch.setattr(load, "ALONE_BYTES", 1024)  # this small file takes the large files' path
    monkeypatch.setattr(batches, "ALONE_BYTES", 1024)
    calls = []
    real = Store.start_writeback
    monkeypatch.setattr(Store, "start_writeback", lambda self: calls.append(1) or real(self))
    db = tmp_path / "drift.duckdb"
    store = Store(db)
    out = ingest_paths(store, [tokens_file(tmp_path / "tokens.parquet")])
    assert [o.status for o in out] == ["loaded"]
    assert calls and store._writeback is not None  # once per batch DuckDB took, with the store's descriptor
    assert store.sql("SELECT count(*) AS n FROM tokens")["n"][0] == 20_000
    assert not another_process_can_write(db)  # DuckDB's lock still held after the load
    store.close()
    assert store._writeback is None
    assert another_process_can_write(db)


def test_a_small_load_opens_no_descriptor(tmp_path):
    store = Store(tmp_path / "drift.duckdb")
    ingest_paths(store, [tokens_file(tmp_path / "tokens.parquet", n=2_000)])
    assert store._writeback is None
    store.close()


@linux_only
def test_the_kernel_takes_the_request_on_a_read_only_descriptor(tmp_path):
    f = tmp_path / "file"
    with open(f, "wb") as fp:
        fp.write(b"x" * (1 << 20))  # dirty pages of a file this process did not open read-only
    w = writeback.Writeback(f)
    assert w.start()
    w.close()
    assert not w.start()  # closed: nothing asked


def test_nothing_for_a_database_in_memory_or_read_only(tmp_path):
    mem = Store(":memory:")
    mem.start_writeback()
    assert mem._writeback is None
    mem.close()
    Store(tmp_path / "d.duckdb").close()
    ro = Store(tmp_path / "d.duckdb", read_only=True)
    ro.start_writeback()
    assert ro._writeback is None
    ro.close()
