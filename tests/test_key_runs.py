"""Narrow token and routing rows of a file in key order go to the tables whose key columns have a fixed (RLE)
compression; a file whose keys come in short runs goes to their twins, where DuckDB picks the compression
(schema.KEY_RUN, FIXED_COMPRESSION). Both read back through the views, row for row."""
from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis import schema
from analysis.ingest import ingest_paths
from analysis.ingest.keys import in_key_runs
from analysis.store import Store


def _reference(columns: list[list]) -> bool:
    """Plain Python: rows whose key tuple differs from the row before, times KEY_RUN, at most the rows."""
    keys = list(zip(*columns))
    changes = sum(a != b for a, b in zip(keys, keys[1:]))
    return changes * schema.KEY_RUN <= len(keys)


@pytest.mark.parametrize("table", ["tokens", "routing"])
@pytest.mark.parametrize("seed", range(6))
def test_in_key_runs_matches_a_plain_count_of_key_changes(table, seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 400))
    run_len = int(rng.choice([1, 4, 15, 16, 17, 64]))  # around KEY_RUN, both sides
    key = np.arange(n) // run_len
    step, sample, pos = key // 7, key % 7, (key * 3) % 5
    if seed % 2:  # a few rows swapped: shorter runs somewhere
        i = rng.integers(0, n, 3)
        sample[i] = sample[i[::-1]]
    runs = np.where(np.arange(n) < n // 2, "a", "b") if seed % 3 == 0 else np.full(n, "a")
    data = {"run": runs.tolist(), "step": step, "sample": sample}
    cols = [data["run"], step.tolist(), sample.tolist()]
    if table == "routing":
        data["pos"] = pos
        cols.append(pos.tolist())
    want = _reference(cols)
    assert in_key_runs(table, pa.table(data)) is want
    codes = pa.table({"run_id": np.unique(runs, return_inverse=True)[1].astype(np.int32)} |
                     {k: v for k, v in data.items() if k != "run"})
    assert in_key_runs(table, codes) is want


def _tokens(run: str, n_seq: int, length: int, seed: int) -> dict[str, list]:
    rng = np.random.default_rng(seed)
    n = n_seq * length
    s = -rng.exponential(1.0, n)
    return {"run": [run] * n, "step": (np.arange(n) // (4 * length)).tolist(),
            "sample": (np.arange(n) // length).tolist(), "pos": (np.arange(n) % length).tolist(),
            "token_id": rng.integers(0, 50_000, n).tolist(), "sampler_logprob": s.tolist(),
            "trainer_logprob": np.minimum(s + rng.normal(0, 1e-3, n), 0.0).tolist()}


def _routing(tokens: dict[str, list], layers: int, seed: int, layer_major: bool) -> list[dict]:
    rng = np.random.default_rng(seed)
    keys = list(zip(tokens["step"], tokens["sample"], tokens["pos"]))
    order = [(layer, key) for layer in range(layers) for key in keys] if layer_major else \
        [(layer, key) for key in keys for layer in range(layers)]
    rows = []
    for layer, (step, sample, pos) in order:
        experts = rng.choice(16, 2, replace=False).tolist()
        trainer = experts if rng.random() < 0.9 else experts[::-1]
        rows.append({"run": tokens["run"][0], "step": step, "sample": sample, "pos": pos, "layer": layer,
                     "sampler_experts": experts, "trainer_experts": trainer})
    return rows


def _shuffled(columns: dict[str, list], seed: int) -> dict[str, list]:
    perm = np.random.default_rng(seed).permutation(len(columns["step"]))
    return {k: [v[i] for i in perm] for k, v in columns.items()}


def _count(store: Store, table: str) -> int:
    return store.scalar(f"SELECT count(*) FROM {table}")


def test_files_in_key_order_and_not_go_to_their_tables_and_read_back_alike(tmp_path):
    ordered = _tokens("ordered", n_seq=10, length=64, seed=1)
    loose = _shuffled(_tokens("loose", n_seq=10, length=64, seed=2), seed=3)
    files = []
    for name, cols in (("a.parquet", ordered), ("b.parquet", loose)):
        pq.write_table(pa.table(cols), tmp_path / name)
        files.append(tmp_path / name)
    # 20 layers a token: runs of 20 rows per (step, sample, pos) where the layers are innermost, of 1 where outermost
    r_ordered, r_loose = _routing(ordered, 20, seed=4, layer_major=False), _routing(loose, 20, seed=5, layer_major=True)
    for name, rows in (("ra.parquet", r_ordered), ("rb.parquet", r_loose)):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
        files.append(tmp_path / name)
    store = Store(tmp_path / "d.duckdb")
    assert [o.status for o in ingest_paths(store, files)] == ["loaded"] * 4
    n = len(ordered["run"])
    assert (_count(store, schema.TOKEN_STORE), _count(store, schema.TOKEN_STORE_LOOSE)) == (n, n)
    assert (_count(store, schema.ROUTING_PACKED_STORE), _count(store, schema.ROUTING_PACKED_LOOSE)) == (20 * n, 20 * n)
    cols = list(schema.TOKEN_NARROW)
    for run, want in (("ordered", ordered), ("loose", loose)):
        got = store.rows(f"SELECT {', '.join(cols)} FROM tokens WHERE run = ? ORDER BY step, sample, pos", [run])
        assert got == sorted(zip(*(want[c] for c in cols)), key=lambda r: r[1:4])
    for run, rows in (("ordered", r_ordered), ("loose", r_loose)):
        got = store.rows("SELECT step, sample, pos, layer, sampler_experts, trainer_experts FROM routing "
                         "WHERE run = ? ORDER BY ALL", [run])
        assert got == sorted((r["step"], r["sample"], r["pos"], r["layer"], r["sampler_experts"],
                              r["trainer_experts"]) for r in rows)
    store.delete_run("loose")
    assert _count(store, schema.TOKEN_STORE_LOOSE) == 0 and _count(store, schema.ROUTING_PACKED_LOOSE) == 0
    assert _count(store, schema.TOKEN_STORE) == n


def _compression(store: Store, table: str, column: str) -> set[str]:
    return {r[0] for r in store.rows("SELECT compression FROM pragma_storage_info(?) WHERE column_name = ? "
                                     "AND segment_type <> 'VALIDITY'", [table, column])}


def test_the_keyed_table_fixes_rle_and_its_twin_leaves_duckdb_the_choice(tmp_path):
    """150k shuffled tokens: DuckDB bit-packs their sample ids in the twin, where the fixed RLE (runs of one row)
    would have doubled the column; the same rows in key order are RLE in the keyed table."""
    ordered = _tokens("ordered", n_seq=1_500, length=100, seed=6)
    loose = _shuffled(_tokens("loose", n_seq=1_500, length=100, seed=7), seed=8)
    for name, cols in (("a.parquet", ordered), ("b.parquet", loose)):
        pq.write_table(pa.table(cols), tmp_path / name)
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [tmp_path / "a.parquet", tmp_path / "b.parquet"])
    assert [o.status for o in out] == ["loaded"] * 2
    with store.transaction() as w:
        w.execute("CHECKPOINT")
    assert _compression(store, schema.TOKEN_STORE, "sample") == {"RLE"}
    assert "RLE" not in _compression(store, schema.TOKEN_STORE_LOOSE, "sample")
    ddl = store.scalar("SELECT sql FROM duckdb_tables() WHERE table_name = ?", [schema.TOKEN_STORE])
    for column, method in schema.FIXED_COMPRESSION[schema.TOKEN_STORE].items():
        assert re.search(rf'\b"?{column}"? \w+ USING COMPRESSION {method}\b', ddl, re.IGNORECASE), (column, ddl)
