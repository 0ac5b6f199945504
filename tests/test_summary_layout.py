"""Summary layout 2 (docs/SCHEMA.md): one wide row per sequence / bucket and file, the ratio-band split in the
narrow *_band tables; a database written with layout 1 (band key in the wide rows) opens and gives the same
metrics."""
from __future__ import annotations

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from analysis import schema
from analysis.ingest import ingest_paths, summary_files
from analysis.metrics import buckets, report
from analysis.store import Store, StoreError
from analysis.summaries import schema as S
from analysis.summaries import sql as compute

from helpers.data import load_files, metrics_make_routing, metrics_make_tokens
from helpers.reference import assert_frames_close

# the layout-1 tables as that version created them (schema.py before the band split moved out)
_SUMS = ", ".join(f"{c.name} {c.sql_type}" for c in S.TOKEN_SUMS)
LAYOUT1_DDL = {
    "summary_seq": f"CREATE TABLE summary_seq (run VARCHAR, step BIGINT, sample BIGINT, band SMALLINT, "
                   f"max_pos INTEGER, {_SUMS}, n_flip_tokens BIGINT, file_id INTEGER)",
    "summary_bucket": f"CREATE TABLE summary_bucket (run VARCHAR, step BIGINT, dim VARCHAR, bucket BIGINT, "
                      f"band SMALLINT, {_SUMS}, file_id INTEGER)",
}


def _layout1_rows(cur) -> None:
    """Fill the layout-1 tables from the token rows as layout-1 ingest did: one wide row per (sequence, band)
    and per (bucket, band), and one routing row per (sequence, band) of its routed tokens."""
    cols = ("run, step, sample, pos, sampler_logprob AS s, trainer_logprob AS t, sampler_entropy, "
            "trainer_version, sampler_version, file_id")
    dims = {"prob": "b_prob", "position": "b_position", "entropy": "b_entropy", "lag": "b_lag"}
    terms = compute.token_terms_sql(f"SELECT {cols} FROM tokens")
    banded = compute.with_bin_sql(f"SELECT *, {', '.join(f'{compute.bucket_sql(d)} AS {c}' for d, c in dims.items())}"
                                  f" FROM ({terms}) x_", "d", "be", len(S.BAND_EDGES), "band")
    params = compute.edge_params("be", S.BAND_EDGES) | compute.bucket_params()
    agg = compute.token_sums_sql()
    cur.execute(f"INSERT INTO summary_seq SELECT run, step, sample, band, max(pos), {agg}, NULL, file_id "
                f"FROM ({banded}) GROUP BY run, step, sample, band, file_id", params)
    which = " ".join(f"WHEN '{d}' THEN {c}" for d, c in dims.items())
    cur.execute(f"""INSERT INTO summary_bucket SELECT run, step, dim, bucket, band, {agg}, file_id FROM (
                        SELECT *, CASE dim {which} END AS bucket FROM ({banded}) b_
                        CROSS JOIN (VALUES {', '.join(f"('{d}')" for d in dims)}) v_(dim)) u_
                    WHERE bucket IS NOT NULL GROUP BY run, step, dim, bucket, band, file_id""", params)
    # routing rows: flipped tokens per (sequence, band of the token), n_tokens 0
    flips = compute.with_bin_sql(compute.token_terms_sql(
        """SELECT r.run, r.step, r.sample, r.file_id, bool_or(r.flip) AS fl, any_value(t.sampler_logprob) AS s,
                  any_value(t.trainer_logprob) AS t
           FROM routing r JOIN tokens t USING (run, step, sample, pos) WHERE r.flip IS NOT NULL
           GROUP BY r.run, r.step, r.sample, r.pos, r.file_id"""), "d", "be", len(S.BAND_EDGES), "band")
    cur.execute(f"""INSERT INTO summary_seq (run, step, sample, band, n_tokens, n_flip_tokens, file_id)
                    SELECT run, step, sample, band, 0, count_if(fl), file_id FROM ({flips})
                    GROUP BY run, step, sample, band, file_id""", compute.edge_params("be", S.BAND_EDGES))


def _views(store: Store) -> dict:
    out = {f"{by} {cap} {clip}": report.metrics_table(store, ["a", "b"], by=by, cap=cap, clip=clip)
           for by in ("step", "run") for cap, clip in ((2.0, 0.2), (1.5, 0.28), (10.0, 0.5))}
    out["layer"] = report.metrics_table(store, ["a", "b"], by="layer")
    for dim in (d for d in buckets.DIMENSIONS if d not in ("tag", "segment")):  # these logs have no tags nor turns
        for cap, clip in ((2.0, 0.2), (1.2, 0.1)):
            chosen = None if dim == "length" else ["n_tokens", "kl_k1", "kl_k3", "ratio_frac_high",
                                                   "ratio_frac_low", "clip_frac", "ess", "ratio_std"]
            out[f"{dim} {cap}"] = buckets.mismatch_by(store, ["a", "b"], dim, cap=cap, clip=clip, metrics=chosen)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    tokens = metrics_make_tokens(seed=211, runs=("a", "b"), steps=(0, 1, 2), n_seq=5, max_len=40)
    routing = metrics_make_routing(tokens, seed=212, layers=3)
    # run b's first step in two token files: a layout-1 row per (sequence, band, file)
    parts = [("t0.parquet", tokens.filter((pl.col("run") == "b") & (pl.col("step") == 0) & (pl.col("pos") < 7))),
             ("t1.parquet", tokens.filter(~((pl.col("run") == "b") & (pl.col("step") == 0) & (pl.col("pos") < 7)))),
             ("r.parquet", routing)]
    return tmp_path_factory.mktemp("layout"), parts


def test_layout2_rows_one_per_sequence_and_bucket(tmp_path, loaded):
    _, parts = loaded
    store = load_files(tmp_path, "v2", parts)
    # wide rows carry no band: one per (run, step, sample, file) resp. (run, step, dim, bucket, file)
    assert store.scalar("SELECT count(*) FROM (SELECT run, step, sample, file_id FROM summary_seq "
                        "GROUP BY ALL HAVING count(*) > 1)") == 0
    assert store.scalar("SELECT count(*) FROM (SELECT run, step, dim, bucket, file_id FROM summary_bucket "
                        "GROUP BY ALL HAVING count(*) > 1)") == 0
    # the band tables hold exactly the wide rows' tokens and r − 1 sums, split by band
    for wide, band, key in (("summary_seq", "summary_seq_band", "run, step, sample, file_id"),
                            ("summary_bucket", "summary_bucket_band", "run, step, dim, bucket, file_id")):
        bad = store.scalar(f"""SELECT count(*) FROM (SELECT {key}, n_tokens, sum_rm1 FROM {wide} WHERE n_tokens > 0) w
            FULL JOIN (SELECT {key}, sum(n_tokens) AS n, sum(sum_rm1) AS r FROM {band} GROUP BY ALL) b
            USING ({key}) WHERE w.n_tokens IS DISTINCT FROM b.n OR abs(w.sum_rm1 - b.r) > 1e-12 * (1 + abs(b.r))""")
        assert bad == 0, wide
        assert store.scalar(f"SELECT count(*) FROM {band} WHERE n_tokens <= 0") == 0
    n_tok = store.scalar("SELECT count(*) FROM tokens")
    assert store.scalar("SELECT sum(n_tokens) FROM summary_seq_band") == n_tok
    assert store.scalar("SELECT sum(n_tokens) FROM summary_bucket_band WHERE dim = 'position'") == n_tok
    store.close()


def test_a_layout1_database_opens_with_the_same_metrics(tmp_path, loaded):
    _, parts = loaded
    store = load_files(tmp_path, "v1", parts)
    want = _views(store)
    cur = store.cursor()
    for table in ("summary_seq", "summary_bucket", "summary_seq_band", "summary_bucket_band"):
        cur.execute(f"DROP TABLE {table}")
    for sql in LAYOUT1_DDL.values():
        cur.execute(sql)
    _layout1_rows(cur)
    n_band_rows = store.scalar("SELECT count(*) FROM summary_seq WHERE n_tokens > 0")
    _layout1_summary_file(store, tmp_path / "layout1-summary.parquet")
    assert n_band_rows > store.scalar("SELECT count(DISTINCT (run, step, sample, file_id)) FROM summary_seq")
    # the conversion reads summary rows only: without token rows (a DriftLogger run's may be a sample) it
    # must give the same metrics
    for table in schema.stored_tables("tokens"):
        cur.execute(f"DELETE FROM {table}")
    store.close()
    path = tmp_path / "v1.duckdb"
    with pytest.raises(StoreError, match="older layout .*--db"):
        Store(path, read_only=True)
    store = Store(path)
    assert "band" not in S.columns("summary_seq")
    assert "band" not in store.sql("SELECT * FROM summary_seq LIMIT 0").columns
    assert store.scalar("SELECT count(*) FROM summary_seq_band") == n_band_rows
    got = _views(store)
    for key, df in want.items():
        assert df.height > 0, key
        assert_frames_close(got[key], df)
    store.close()
    Store(path, read_only=True).close()  # converted once: read-only opens work again
    # a summary file of layout 1 (DriftLogger before layout 2) loads into the same tables
    fresh = Store(tmp_path / "from-file.duckdb")
    (outcome,) = ingest_paths(fresh, [tmp_path / "layout1-summary.parquet"])
    assert outcome.status == "loaded", outcome.line()
    assert fresh.scalar("SELECT count(*) FROM summary_seq_band") == n_band_rows
    got = _views(fresh)
    for key, df in want.items():
        assert_frames_close(got[key], df)
    fresh.close()


def _layout1_summary_file(store: Store, path) -> None:
    """The database's summary rows as a layout-1 summary file (format version 1, band key in summary_seq and
    summary_bucket rows)."""
    parts = []
    for table in ("summary_step", "summary_seq", "summary_hist", "summary_bucket", "summary_layer", "expert_load"):
        rows = store.arrow(f"SELECT * EXCLUDE (file_id) FROM {table}")
        parts.append(rows.append_column(summary_files.TABLE_COLUMN, pa.array([table] * rows.num_rows, pa.string())))
    table = pa.concat_tables(parts, promote_options="permissive")
    pq.write_table(table.replace_schema_metadata({summary_files.SUMMARY_KEY: summary_files.LAYOUT1}), path)
