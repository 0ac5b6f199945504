"""Compact routing storage: the trainer's top-k list is stored only where it differs from the sampler's (rank for
rank); the `routing` view gives every reader SCHEMA.md's lists back; databases of the earlier layout migrate."""
from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from analysis import schema
from analysis.ingest import ingest_paths
from analysis.store import Store
from test_ingest_roundtrip import check_derived, make_logs


def _load(tmp_path, rows, tokens):
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "routing.parquet")
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [tmp_path / "tokens.parquet", tmp_path / "routing.parquet"])
    assert [o.status for o in out] == ["loaded", "loaded"]
    return store


def test_trainer_lists_are_stored_only_where_they_differ(tmp_path):
    tokens, rows = make_logs(seed=5, steps=2, samples=3, length=6, layers=4, k=3)
    store = _load(tmp_path, rows, tokens)
    differ = sum(r["trainer_experts"] != r["sampler_experts"] for r in rows)
    assert 0 < differ < len(rows)
    assert store.scalar(f"SELECT count(trainer_experts) FROM {schema.ROUTING_STORE}") == differ
    got = store.rows("SELECT step, sample, pos, layer, sampler_experts, trainer_experts FROM routing ORDER BY ALL")
    assert got == sorted((r["step"], r["sample"], r["pos"], r["layer"], r["sampler_experts"], r["trainer_experts"])
                         for r in rows)
    check_derived(store, rows)
    store.delete_run("r")
    assert store.scalar("SELECT count(*) FROM routing") == 0 and store.files().height == 0


def test_sampler_only_routing_keeps_a_missing_trainer_side_missing(tmp_path):
    tokens, rows = make_logs(seed=6, steps=1, samples=2, length=3, layers=2)
    for r in rows:
        del r["trainer_experts"]
    store = _load(tmp_path, rows, tokens)
    assert store.rows("SELECT count(*), count(trainer_experts), count(flip) FROM routing") == [(len(rows), 0, 0)]


def test_a_database_with_the_earlier_routing_table_is_migrated(tmp_path):
    tokens, rows = make_logs(seed=7, steps=1, samples=2, length=4, layers=3)
    db = tmp_path / "d.duckdb"
    store = _load(tmp_path, rows, tokens)
    want = store.rows("SELECT * FROM routing ORDER BY ALL")
    store.close()
    con = duckdb.connect(str(db))  # rebuild the earlier layout: one plain table with both lists in every row
    con.execute("CREATE TABLE routing_old AS SELECT * FROM routing")
    con.execute("DROP VIEW routing")
    con.execute(f"DROP TABLE {schema.ROUTING_STORE}")
    con.execute("ALTER TABLE routing_old RENAME TO routing")
    assert con.execute("SELECT count(trainer_experts) FROM routing").fetchall() == [(len(rows),)]
    con.close()
    store = Store(db)
    assert store.rows("SELECT * FROM routing ORDER BY ALL") == want
    differ = sum(r["trainer_experts"] != r["sampler_experts"] for r in rows)
    assert store.scalar(f"SELECT count(trainer_experts) FROM {schema.ROUTING_STORE}") == differ


def test_a_trainer_column_of_nulls_only_loads_as_the_sampler_side(tmp_path):
    """A routing file whose trainer_experts column exists but is null on every row (a replay dump written with
    both columns) is the sampler side alone: it loads, with no flip columns, instead of failing on an empty
    trainer matrix (a crash this once was, reported as an internal error)."""
    tokens, rows = make_logs(seed=6, steps=1, samples=2, length=4, layers=2, k=2)
    for r in rows:
        r["trainer_experts"] = None
    table = pa.Table.from_pylist(rows).cast(pa.Table.from_pylist(rows).schema.set(
        pa.Table.from_pylist(rows).schema.get_field_index("trainer_experts"),
        pa.field("trainer_experts", pa.list_(pa.int32()))))
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    pq.write_table(table, tmp_path / "routing.parquet")
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [tmp_path / "tokens.parquet", tmp_path / "routing.parquet"])
    assert [o.status for o in out] == ["loaded", "loaded"], [o.line() for o in out]
    assert store.scalar("SELECT count(*) FROM routing") == len(rows)
    assert store.scalar("SELECT count(flip) + count(trainer_experts) FROM routing") == 0
    assert store.routing_sides() == {tokens["run"][0]: False}
