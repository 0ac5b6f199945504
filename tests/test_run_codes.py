"""Run codes in the stored rows: token and routing rows hold a run's integer code (schema.RUN_IDS) where SCHEMA.md
has its name, and the views join the name back. Files of several runs, runs deleted and loaded again, and
databases whose stored rows still hold names (the layout before run codes) all read back exactly."""
from __future__ import annotations

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

from analysis import schema
from analysis.ingest import ingest_paths
from analysis.metrics import report
from analysis.store import Store

from helpers.ingest import NARROW, PACKED, make_logs
from helpers.ingest import STORED as BOTH_ROUTING


def _logs(run, seed, **kw):
    tokens, rows = make_logs(seed=seed, run=run, steps=2, samples=2, length=3, layers=2, **kw)
    return tokens, rows


def _write(path, tokens=None, rows=None):
    if tokens is not None:
        pq.write_table(pa.table(tokens), path)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _merge(*dicts):
    return {k: sum((d[k] for d in dicts), []) for k in dicts[0]}


def _token_view(store):
    return store.rows("SELECT run, step, sample, pos, token_id, sampler_logprob, trainer_logprob FROM tokens "
                      "ORDER BY ALL")


def _want_tokens(*tokens):
    cols = ("run", "step", "sample", "pos", "token_id", "sampler_logprob", "trainer_logprob")
    return sorted(tuple(t[c][i] for c in cols) for t in tokens for i in range(len(t["run"])))


def _want_routing(*rows):
    return sorted((r["run"], r["step"], r["sample"], r["pos"], r["layer"], r["sampler_experts"],
                   r["trainer_experts"]) for rs in rows for r in rs)


ROUTING = "SELECT run, step, sample, pos, layer, sampler_experts, trainer_experts FROM routing ORDER BY ALL"


def test_a_file_of_several_runs_stores_codes_and_reads_back_names(tmp_path):
    (ta, ra), (tb, rb) = _logs("alpha", 1), _logs("beta", 2)
    narrow = {k: v for k, v in _merge(ta, tb).items() if k in schema.TOKEN_NARROW}
    files = [_write(tmp_path / "t.parquet", narrow), _write(tmp_path / "r.parquet", rows=ra + rb)]
    store = Store(tmp_path / "d.duckdb")
    assert [o.status for o in ingest_paths(store, files)] == ["loaded", "loaded"]
    assert _token_view(store) == _want_tokens(ta, tb)
    assert store.rows(ROUTING) == _want_routing(ra, rb)
    codes = dict(store.rows(f"SELECT run, run_id FROM {schema.RUN_IDS}"))
    assert sorted(codes) == ["alpha", "beta"] and len(set(codes.values())) == 2
    # each stored row carries its own run's code, in both stored tables
    for stored, n in ((NARROW, len(ta["run"])), (PACKED, len(ra))):
        assert store.scalar(f"SELECT count(*) FROM {stored} WHERE run_id = ?", [codes["alpha"]]) == n
    # a run given with --run gets a code of its own; names are never compared by code across databases
    (tc, _) = _logs("ignored", 3)
    out = ingest_paths(store, [_write(tmp_path / "c.parquet", tc)], run="gamma")
    assert out[0].status == "loaded"
    assert store.scalar(f"SELECT count(*) FROM {schema.RUN_IDS}") == 3
    assert store.scalar("SELECT count(*) FROM tokens WHERE run = 'gamma'") == len(tc["run"])


def test_deleting_a_run_frees_its_name_and_loading_it_again_reads_back_the_same(tmp_path):
    (ta, ra), (tb, _) = _logs("a", 4), _logs("b", 5)
    store = Store(tmp_path / "d.duckdb")
    files = [_write(tmp_path / "a.parquet", ta), _write(tmp_path / "ar.parquet", rows=ra),
             _write(tmp_path / "b.parquet", tb)]
    assert {o.status for o in ingest_paths(store, files)} == {"loaded"}
    metrics = report.metrics_table(store, ["a"], by="step")
    store.delete_run("a")
    assert store.rows(f"SELECT run FROM {schema.RUN_IDS}") == [("b",)]
    for stored in (*schema.stored_tables("tokens"), *schema.stored_tables("routing")):
        assert store.scalar(f"SELECT count(*) FROM {stored} WHERE run_id NOT IN "
                            f"(SELECT run_id FROM {schema.RUN_IDS})") == 0
    assert _token_view(store) == _want_tokens(tb)
    assert {o.status for o in ingest_paths(store, files[:2])} == {"loaded"}
    assert _token_view(store) == _want_tokens(ta, tb)
    assert store.rows(ROUTING) == _want_routing(ra)
    assert report.metrics_table(store, ["a"], by="step").equals(metrics)


def test_a_refused_file_leaves_no_code_behind(tmp_path):
    ta, _ = _logs("bad", 6)
    ta["sampler_logprob"][-1] = 0.5  # a log-probability above 0: the file is refused, after its first rows
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [_write(tmp_path / "bad.parquet", ta)])
    assert out[0].status == "refused"
    assert store.scalar(f"SELECT count(*) FROM {schema.RUN_IDS}") == 0


def test_a_database_with_run_names_in_the_stored_rows_is_read_and_written_as_it_is(tmp_path):
    """The layout before run codes (token_rows, token_rows_full and routing_rows with a `run` name column) is not
    rewritten, which would double the database file: the views read it as it is, loads add names to it, and
    delete_run removes them. The packed routing table, newer than run codes, is made with codes when such a
    database is opened, and a later load's packed routing rows go there."""
    (ta, ra), (tb, rb) = _logs("a", 7), _logs("b", 8)
    narrow = {k: v for k, v in ta.items() if k in schema.TOKEN_NARROW}
    db = tmp_path / "d.duckdb"
    store = Store(db)
    files = [_write(tmp_path / "a.parquet", narrow), _write(tmp_path / "b.parquet", tb),
             _write(tmp_path / "r.parquet", rows=ra + rb)]
    assert {o.status for o in ingest_paths(store, files)} == {"loaded"}
    tokens_want = store.rows("SELECT * FROM tokens ORDER BY ALL")
    routing_want = store.rows("SELECT * FROM routing ORDER BY ALL")
    metrics = report.metrics_table(store, ["a", "b"], by="step")
    store.close()
    con = duckdb.connect(str(db))  # rebuild the earlier layout: names in the stored rows, no run_ids
    con.execute("DROP VIEW tokens")
    con.execute("DROP VIEW routing")
    for stored in (*schema.stored_tables("tokens"), schema.ROUTING_STORE):
        source = BOTH_ROUTING if stored == schema.ROUTING_STORE else stored
        con.execute(f"CREATE TABLE _old AS SELECT r.run, x.* EXCLUDE (run_id) FROM {source} x "
                    f"JOIN {schema.RUN_IDS} r USING (run_id)")
        con.execute(f"DROP TABLE {stored}")
        con.execute(f"ALTER TABLE _old RENAME TO {stored}")
    con.execute(f"DROP TABLE {schema.ROUTING_PACKED_STORE}")
    con.execute(f"DROP TABLE {schema.ROUTING_PACKED_LOOSE}")
    con.execute(f"DROP TABLE {schema.RUN_IDS}")
    con.close()
    store = Store(db)
    for stored in (*schema.stored_tables("tokens"), schema.ROUTING_STORE):
        cols = [r[0] for r in store.rows("SELECT column_name FROM duckdb_columns() WHERE table_name = ? "
                                         "ORDER BY column_index", [stored])]
        assert cols[0] == "run" and "run_id" not in cols
    assert store.rows("SELECT * FROM tokens ORDER BY ALL") == tokens_want
    assert store.rows("SELECT * FROM routing ORDER BY ALL") == routing_want
    assert report.metrics_table(store, ["a", "b"], by="step").equals(metrics)
    (tc, rc) = _logs("c", 9)  # later loads write names into these tables
    out = ingest_paths(store, [_write(tmp_path / "c.parquet", tc), _write(tmp_path / "rc.parquet", rows=rc)])
    assert {o.status for o in out} == {"loaded"}
    assert _token_view(store) == _want_tokens(ta, tb, tc)
    assert store.rows(ROUTING) == _want_routing(ra, rb, rc)
    assert store.rows(f"SELECT run FROM {schema.RUN_IDS}") == [("c",)]  # its routing rows, in the packed table
    assert store.scalar(f"SELECT count(*) FROM {PACKED}") == len(rc)
    store.delete_run("a")
    assert _token_view(store) == _want_tokens(tb, tc)
    assert store.rows(ROUTING) == _want_routing(rb, rc)
