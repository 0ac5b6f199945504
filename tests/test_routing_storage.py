"""Compact routing storage: the trainer's top-k list is stored only where it differs from the sampler's (rank for
rank), the sampler's as one packed integer where its ids fit 64 bits; the `routing` view gives every reader
SCHEMA.md's lists back; databases of the earlier layouts migrate."""
from __future__ import annotations

import duckdb
import numpy as np
import pytest
import pyarrow as pa
import pyarrow.parquet as pq

from analysis import schema
from analysis.ingest import ingest_paths
from analysis.store import Store

from helpers.ingest import PACKED, STORED, check_derived, make_logs


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
    assert store.scalar(f"SELECT count(trainer_experts) FROM {STORED}") == differ
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
    con.execute(f"DROP TABLE {schema.ROUTING_PACKED_STORE}")
    con.execute(f"DROP TABLE {schema.ROUTING_PACKED_LOOSE}")
    con.execute("ALTER TABLE routing_old RENAME TO routing")
    assert con.execute("SELECT count(trainer_experts) FROM routing").fetchall() == [(len(rows),)]
    con.close()
    store = Store(db)
    assert store.rows("SELECT * FROM routing ORDER BY ALL") == want
    differ = sum(r["trainer_experts"] != r["sampler_experts"] for r in rows)
    assert store.scalar(f"SELECT count(trainer_experts) FROM {STORED}") == differ


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


@pytest.mark.parametrize("k, experts", [(1, 2), (2, 8), (8, 256), (8, 300), (4, 1 << 16), (5, 1 << 13)])
def test_sampler_lists_are_packed_where_k_ids_fit_64_bits(tmp_path, k, experts):
    """The stored form follows the batch's largest id (bits = its bit length, packed iff k · bits <= 64: top-8 of
    256 experts just fits, top-8 of 300 does not; so do top-4 of 65,536 and top-5 of 8,192), and the view gives
    back every list as written, both sides."""
    tokens, rows = make_logs(seed=k * 7 + experts % 97, steps=2, samples=2, length=5, layers=3, k=k, experts=experts)
    store = _load(tmp_path, rows, tokens)
    bits = max(1, max(max(r["sampler_experts"]) for r in rows).bit_length())
    packed = k * bits <= 64
    n = len(rows)
    assert store.rows(f"SELECT count(sampler_packed), count(sampler_experts), min(id_bits), max(id_bits) "
                      f"FROM {STORED}") == [(n, 0, bits, bits) if packed else (0, n, None, None)]
    # packed rows without weights go to the packed table, the others keep their lists in the wide one
    counts = [store.scalar(f"SELECT count(*) FROM {t}") for t in (schema.ROUTING_STORE, PACKED)]
    assert counts == ([0, n] if packed else [n, 0])
    got = store.rows("SELECT step, sample, pos, layer, sampler_experts, trainer_experts FROM routing ORDER BY ALL")
    assert got == sorted((r["step"], r["sample"], r["pos"], r["layer"], r["sampler_experts"], r["trainer_experts"])
                         for r in rows)
    check_derived(store, rows)


def test_a_database_of_routing_rows_without_packed_ids_is_migrated(tmp_path):
    """routing_rows of the layout before the packed ids (lists only) gain the two columns when the database is
    opened for writing; its rows read as before, and a file loaded afterwards, packed, reads beside them."""
    tokens, rows = make_logs(seed=8, steps=1, samples=2, length=4, layers=3, k=2)
    db = tmp_path / "d.duckdb"
    store = _load(tmp_path, rows, tokens)
    want = store.rows("SELECT * FROM routing ORDER BY ALL")
    store.close()
    con = duckdb.connect(str(db))  # the earlier layout: the same rows with the sampler's list, no packed columns
    con.execute(f"""CREATE TABLE old_rows AS SELECT x.* EXCLUDE (sampler_packed, id_bits)
                    REPLACE ({schema.SAMPLER_EXPERTS_SQL} AS sampler_experts) FROM {STORED} x""")
    con.execute("DROP VIEW routing")
    con.execute(f"DROP TABLE {schema.ROUTING_STORE}")
    con.execute(f"DROP TABLE {schema.ROUTING_PACKED_STORE}")
    con.execute(f"DROP TABLE {schema.ROUTING_PACKED_LOOSE}")
    con.execute(f"ALTER TABLE old_rows RENAME TO {schema.ROUTING_STORE}")
    con.execute("""CREATE VIEW routing AS SELECT r.run, x.* EXCLUDE (run_id) REPLACE (CASE WHEN x.trainer_experts
                   IS NOT NULL THEN x.trainer_experts WHEN x.flip IS NOT NULL THEN x.sampler_experts END
                   AS trainer_experts) FROM routing_rows x JOIN run_ids r ON x.run_id = r.run_id""")
    assert con.execute("SELECT * FROM routing ORDER BY ALL").fetchall() == want
    con.close()
    store = Store(db)
    assert store.rows("SELECT * FROM routing ORDER BY ALL") == want
    tokens2, rows2 = make_logs(seed=9, run="r2", steps=1, samples=2, length=4, layers=3, k=2)
    pq.write_table(pa.table(tokens2), tmp_path / "tokens2.parquet")
    pq.write_table(pa.Table.from_pylist(rows2), tmp_path / "routing2.parquet")
    out = ingest_paths(store, [tmp_path / "tokens2.parquet", tmp_path / "routing2.parquet"])
    assert [o.status for o in out] == ["loaded", "loaded"]
    assert store.rows(f"SELECT count(sampler_packed), count(sampler_experts) FROM {STORED}") \
        == [(len(rows2), len(rows))]
    assert store.rows("SELECT * FROM routing WHERE run = 'r' ORDER BY ALL") == want
    got = store.rows("SELECT step, sample, pos, layer, sampler_experts, trainer_experts FROM routing "
                     "WHERE run = 'r2' ORDER BY ALL")
    assert got == sorted((r["step"], r["sample"], r["pos"], r["layer"], r["sampler_experts"], r["trainer_experts"])
                         for r in rows2)


@pytest.mark.parametrize("layer_base, id_base, dense", [(0, 2**31 - 100, True), (2**31 - 10, 0, True), (0, 0, False)])
def test_large_expert_and_layer_ids_load_exactly(tmp_path, monkeypatch, layer_base, id_base, dense):
    """Expert ids near 2^31 and layer numbers near 2^31 are valid ids: such a file loads (dense expert-load counts
    once refused it as "too large to load"), and its lists, flips and expert load equal the brute-force
    reference. dense=False: an ordinary file counted by the sparse path, which then must agree too."""
    import analysis.ingest.keys as keys
    if not dense:
        monkeypatch.setattr(keys, "DENSE_COUNTS", 0)
    tokens, rows = make_logs(seed=9, steps=2, samples=3, length=5, layers=3, k=3, experts=12)
    for r in rows:
        r["layer"] += layer_base
        r["sampler_experts"] = [e + id_base for e in r["sampler_experts"]]
        r["trainer_experts"] = [e + id_base for e in r["trainer_experts"]]
    store = _load(tmp_path, rows, tokens)
    got = store.rows("SELECT step, sample, pos, layer, sampler_experts, trainer_experts FROM routing ORDER BY ALL")
    assert got == sorted((r["step"], r["sample"], r["pos"], r["layer"], r["sampler_experts"], r["trainer_experts"])
                         for r in rows)
    check_derived(store, rows)
    layers = [row[0] for row in store.rows("SELECT DISTINCT layer FROM summary_layer ORDER BY 1")]
    assert layers == [layer_base + i for i in range(3)]


def test_rows_with_weights_keep_the_wide_table_and_both_tables_read_as_one(tmp_path):
    """A routing file with expert weights goes to the wide table (with its weight lists; the sampler's ids still
    packed), one without them to the packed table; the view reads both as written, and deleting a run empties both."""
    tokens, rows = make_logs(seed=10, run="w", steps=2, samples=2, length=3, layers=2, k=3)
    for i, r in enumerate(rows):
        # fp32 values (weights are stored as FLOAT, what engines ship: schema.ROUTING), so they read back as written
        r["sampler_weights"] = [float(np.float32(1.0 / (c + 2 + i % 5))) for c in range(3)]
        r["trainer_weights"] = None if i % 4 == 0 else [0.5, 0.25, 0.25]
    tokens2, rows2 = make_logs(seed=11, run="p", steps=1, samples=2, length=3, layers=2, k=3)
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    pq.write_table(pa.table(tokens2), tmp_path / "tokens2.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "routing.parquet")
    pq.write_table(pa.Table.from_pylist(rows2), tmp_path / "routing2.parquet")
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [tmp_path / n for n in ("tokens.parquet", "tokens2.parquet", "routing.parquet",
                                                      "routing2.parquet")])
    assert [o.status for o in out] == ["loaded"] * 4, [o.line() for o in out]
    assert store.rows(f"SELECT count(*), count(sampler_weights), count(sampler_packed) FROM {schema.ROUTING_STORE}") \
        == [(len(rows), len(rows), len(rows))]
    assert store.scalar(f"SELECT count(*) FROM {PACKED}") == len(rows2)
    cols = ("run", "step", "sample", "pos", "layer", "sampler_experts", "trainer_experts", "sampler_weights",
            "trainer_weights")
    want = sorted(tuple(r.get(c) for c in cols) for r in rows + rows2)
    assert store.rows(f"SELECT {', '.join(cols)} FROM routing ORDER BY ALL") == want
    check_derived(store, rows + rows2)
    store.delete_run("w")
    assert store.scalar(f"SELECT count(*) FROM {schema.ROUTING_STORE}") == 0
    assert store.scalar(f"SELECT count(*) FROM {PACKED}") == len(rows2)
    store.delete_run("p")
    assert store.scalar(f"SELECT count(*) FROM {STORED}") == 0


def _packed_then_wide(seed: int) -> tuple[dict, list[dict]]:
    """Top-8 routing whose first step names experts below 64 (8 ids of 6 bits pack into one integer) and whose
    second names experts up to 299 (9 bits: 72 > 64, the lists stay lists); a few trainer lists differ."""
    tokens, rows = make_logs(seed=seed, steps=2, samples=2, length=5, layers=3, k=8, experts=300)
    rng = np.random.default_rng(seed)
    for r in rows:
        if r["step"] == 0:
            r["sampler_experts"] = rng.choice(64, 8, replace=False).tolist()
            r["trainer_experts"] = list(r["sampler_experts"]) if rng.random() < 0.6 else \
                r["sampler_experts"][:-1] + [next(e for e in range(64) if e not in r["sampler_experts"])]
    return tokens, rows


def test_a_file_whose_batches_pack_and_then_do_not_loads_into_both_tables(tmp_path):
    """Packing is decided per read batch, so one file can bring packed rows and list rows: each batch goes to its
    table (this file once failed as an internal error, its batches joined into one append), the view reads the
    file back as written, and a key repeated across the two batches is still refused with nothing stored."""
    tokens, rows = _packed_then_wide(12)
    half = sum(r["step"] == 0 for r in rows)  # one Parquet row group per step: one read batch each
    pq.write_table(pa.table(tokens), tmp_path / "tokens.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "routing.parquet", row_group_size=half)
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [tmp_path / "tokens.parquet", tmp_path / "routing.parquet"])
    assert [o.status for o in out] == ["loaded", "loaded"], [o.line() for o in out]
    assert store.scalar(f"SELECT count(*) FROM {PACKED}") == half
    assert store.rows(f"SELECT count(*), count(sampler_experts) FROM {schema.ROUTING_STORE}") \
        == [(len(rows) - half, len(rows) - half)]
    got = store.rows("SELECT step, sample, pos, layer, sampler_experts, trainer_experts FROM routing ORDER BY ALL")
    assert got == sorted((r["step"], r["sample"], r["pos"], r["layer"], r["sampler_experts"], r["trainer_experts"])
                         for r in rows)
    check_derived(store, rows)

    tokens2, rows2 = _packed_then_wide(13)
    tokens2["run"] = ["dup"] * len(tokens2["run"])
    for r in rows2:
        r["run"] = "dup"
    first = next(r for r in rows2 if r["step"] == 0)
    last = next(i for i, r in enumerate(rows2) if r["step"] == 1)  # the wide batch repeats a packed row's key
    rows2[last] = {**rows2[last], **{c: first[c] for c in ("step", "sample", "pos", "layer")}}
    pq.write_table(pa.table(tokens2), tmp_path / "tokens2.parquet")
    pq.write_table(pa.Table.from_pylist(rows2), tmp_path / "routing2.parquet", row_group_size=half)
    out = ingest_paths(store, [tmp_path / "tokens2.parquet", tmp_path / "routing2.parquet"])
    assert [o.status for o in out] == ["loaded", "refused"], [o.line() for o in out]
    assert out[1].rule == "duplicate key" and "layer=0" in out[1].message, out[1].message
    assert store.scalar("SELECT count(*) FROM routing WHERE run = 'dup'") == 0
