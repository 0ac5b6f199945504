"""Split token storage: rows of files without optional columns (token_id aside) go to the narrow `token_rows`,
the others to `token_rows_full`; the `tokens` view shows SCHEMA.md's table over both; databases of the earlier
layout (one plain `tokens` table) migrate on open."""
from __future__ import annotations

import math

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from analysis import schema
from analysis.ingest import ingest_paths
from analysis.metrics import report
from analysis.store import Store

from helpers.ingest import NARROW, make_logs

NARROW_ONLY = ("token", "sampler_version", "trainer_version")


def _write(tmp_path, name, tokens, drop=()):
    table = pa.table({k: v for k, v in tokens.items() if k not in drop})
    pq.write_table(table, tmp_path / name)
    return tmp_path / name


def _expected(tokens, drop=()):
    """The rows the view must show, in SCHEMA.md's column order, None where a column was not in the file."""
    n = len(tokens["run"])
    cols = [c.name for c in schema.TOKENS]
    return sorted(tuple(None if (c in drop or c not in tokens) else tokens[c][i] for c in cols) for i in range(n))


def _view_rows(store):
    cols = ", ".join(c.name for c in schema.TOKENS)
    return sorted(store.rows(f"SELECT {cols} FROM tokens"))


def _mixed(tmp_path):
    """Run 'a' from a file with only the narrow columns, run 'b' from one with every column, and run 'c' split:
    step 0 narrow, step 1 full."""
    a, _ = make_logs(seed=1, run="a", steps=2, samples=3, length=5)
    b, _ = make_logs(seed=2, run="b", steps=2, samples=2, length=4)
    c, _ = make_logs(seed=3, run="c", steps=2, samples=2, length=3)
    c0 = {k: [v for v, s in zip(vals, c["step"]) if s == 0] for k, vals in c.items()}
    c1 = {k: [v for v, s in zip(vals, c["step"]) if s == 1] for k, vals in c.items()}
    files = [_write(tmp_path, "a.parquet", a, NARROW_ONLY), _write(tmp_path, "b.parquet", b),
             _write(tmp_path, "c0.parquet", c0, NARROW_ONLY), _write(tmp_path, "c1.parquet", c1)]
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, files)
    assert [o.status for o in out] == ["loaded"] * 4, [o.line() for o in out]
    want = _expected(a, NARROW_ONLY) + _expected(b) + _expected(c0, NARROW_ONLY) + _expected(c1)
    return store, sorted(want), (a, b, c)


def test_rows_go_to_the_table_of_their_columns_and_the_view_shows_all(tmp_path):
    store, want, (a, b, c) = _mixed(tmp_path)
    n_narrow = len(a["run"]) + c["step"].count(0)
    # sequences of 3-5 tokens are runs too short for the RLE-keyed table: its twin (tests/test_key_runs.py)
    assert store.scalar(f"SELECT count(*) FROM {schema.TOKEN_STORE_LOOSE}") == n_narrow
    assert store.scalar(f"SELECT count(*) FROM {schema.TOKEN_STORE_FULL}") == len(b["run"]) + c["step"].count(1)
    narrow_cols = [r[0] for r in store.rows(
        "SELECT column_name FROM duckdb_columns() WHERE table_name = ? ORDER BY column_index", [schema.TOKEN_STORE])]
    assert narrow_cols == ["run_id", *schema.TOKEN_NARROW[1:], "file_id"]  # run codes, see schema.RUN_IDS
    view_cols = [r[0] for r in store.rows(
        "SELECT column_name FROM duckdb_columns() WHERE table_name = 'tokens' ORDER BY column_index")]
    assert view_cols == schema.names("tokens") + ["file_id"]
    got = _view_rows(store)
    assert len(got) == len(want)
    for g, w in zip(got, want):  # floats exactly as written: the view adds NULLs, never converts
        assert g == w
    # duplicate checks read the view: a key of the narrow table is refused when a full file repeats it
    dup = _write(tmp_path, "again.parquet", {k: v[:2] for k, v in a.items()})
    out = ingest_paths(store, [dup])
    assert out[0].status == "refused" and "already loaded from a.parquet" in out[0].message
    store.delete_run("c")
    assert store.scalar("SELECT count(*) FROM tokens WHERE run = 'c'") == 0
    assert {r[0] for r in store.rows("SELECT name FROM files")} == {"a.parquet", "b.parquet"}


def test_metrics_of_a_run_split_over_both_tables_match_numpy(tmp_path):
    store, _, (_, _, c) = _mixed(tmp_path)
    df = report.metrics_table(store, ["c"], by="step")
    for step in (0, 1):
        s = [x for x, st in zip(c["sampler_logprob"], c["step"]) if st == step]
        t = [x for x, st in zip(c["trainer_logprob"], c["step"]) if st == step]
        d = [ti - si for si, ti in zip(s, t)]
        k3 = math.fsum(math.exp(x) - 1 - x for x in d) / len(d)
        row = df.filter(df["step"] == step)
        assert row["n_tokens"][0] == len(d)
        assert math.isclose(row["kl_k3"][0], k3, rel_tol=1e-12, abs_tol=1e-300)
        assert math.isclose(row["log_ratio_abs_max"][0], max(abs(x) for x in d), rel_tol=1e-15)


def test_a_database_with_the_earlier_tokens_table_is_migrated(tmp_path):
    store, want, _ = _mixed(tmp_path)
    metrics = report.metrics_table(store, ["a", "b", "c"], by="step")
    store.close()
    db = tmp_path / "d.duckdb"
    con = duckdb.connect(str(db))  # the earlier layout: one plain table of every column
    con.execute("CREATE TABLE tokens_old AS SELECT * FROM tokens")
    con.execute("DROP VIEW tokens")
    for stored in schema.stored_tables("tokens"):
        con.execute(f"DROP TABLE {stored}")
    con.execute("ALTER TABLE tokens_old RENAME TO tokens")
    con.close()
    ro = Store(db, read_only=True)  # readers of the earlier layout read its table as it is
    assert _view_rows(ro) == want
    ro.close()
    store = Store(db)
    assert store.scalar("SELECT count(*) FROM duckdb_views() WHERE view_name = 'tokens'") == 1
    assert store.scalar(f"SELECT count(*) FROM {NARROW}") == 0
    assert _view_rows(store) == want
    assert report.metrics_table(store, ["a", "b", "c"], by="step").equals(metrics)
    d, _ = make_logs(seed=4, run="d", steps=1, samples=1, length=3)  # later narrow files go to the new table
    assert ingest_paths(store, [_write(tmp_path, "d.parquet", d, NARROW_ONLY)])[0].status == "loaded"
    assert store.scalar(f"SELECT count(*) FROM {NARROW}") == 3
    store.close()
    assert _view_rows(Store(db, read_only=True)) == sorted(want + _expected(d, NARROW_ONLY))
