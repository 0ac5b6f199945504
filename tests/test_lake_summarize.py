"""`summarize` of a seeded lake on the in-process engine: its summaries equal those of ingesting every token
(counts exactly, sums at rel 1e-12), a partition that breaks SCHEMA.md is reported while the others complete,
the token sample keeps what DriftLogger keeps, and the files carry DriftLogger's names."""
from __future__ import annotations

import polars as pl
import pyarrow.parquet as pq
import pytest

import lake_util as lu
from analysis.ingest import ingest_paths
from analysis.lake import output, partial
from analysis.lake.engines import run_local
from analysis.lake.layout import list_partitions, write_file
from analysis.lake.summarize import summarize
from analysis.store import Store


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    """(lake path, tokens, routing, summaries of ingesting every token directly)."""
    root = tmp_path_factory.mktemp("lake")
    tokens, routing = lu.make_rows()
    lake = lu.write_lake(root / "lake", tokens, routing)
    store = Store(root / "direct.duckdb")
    outcomes = ingest_paths(store, lu.write_flat(root / "flat", tokens, routing))
    assert [o.status for o in outcomes] == ["loaded", "loaded"]
    direct = partial.summary_tables(store)
    store.close()
    return lake, tokens, routing, direct


def test_lake_has_what_the_equality_test_needs(seeded):
    lake, tokens, routing, direct = seeded
    parts = list_partitions(str(lake)).partitions
    assert len(parts) == tokens.select("run", "step").unique().height == 6
    assert all(len(p.files) == 2 * lu.RANKS for p in parts)  # every step split over rank files, both kinds
    flips = direct["summary_layer"].to_pandas().groupby("step")["n_flip"].sum()
    assert (flips > 0).all()  # routing of both sides, with flips


def test_duckdb_engine_equals_direct_ingest(seeded):
    lake, _, _, direct = seeded
    results = list(run_local(str(lake), list_partitions(str(lake)).partitions))
    assert [r.refused for r in results if r.refused] == []
    merged = {t: partial.merge(t, [r.tables[t] for r in results]) for t in partial.MERGED_TABLES}
    lu.assert_same_summaries(merged, direct)


def test_merge_is_addition_min_and_max():
    import pyarrow as pa
    assert partial.merge_plan("summary_hist")[0] == ["run", "step", "bin"]
    rows = [{"run": "r", "step": 1, "bin": 3, "n_tokens": 2, "sum_rm1": 0.5, "sum_rm1_sq": 0.25},
            {"run": "r", "step": 1, "bin": 3, "n_tokens": 5, "sum_rm1": -0.25, "sum_rm1_sq": 1.0},
            {"run": "r", "step": 2, "bin": 3, "n_tokens": 1, "sum_rm1": None, "sum_rm1_sq": 2.0}]
    types = dict(zip(partial.table_columns("summary_hist"), partial.empty_types("summary_hist")))
    t = pa.Table.from_pylist(rows, schema=pa.schema(list(types.items())))
    got = partial.merge("summary_hist", [t.slice(0, 1), t.slice(1)]).to_pylist()
    assert got == [{"run": "r", "step": 1, "bin": 3, "n_tokens": 7, "sum_rm1": 0.25, "sum_rm1_sq": 1.25},
                   {"run": "r", "step": 2, "bin": 3, "n_tokens": 1, "sum_rm1": None, "sum_rm1_sq": 2.0}]
    assert partial.merge("summary_hist", []).num_rows == 0


def test_bad_partition_is_reported_and_the_others_complete(seeded, tmp_path):
    lake, tokens, routing, _ = seeded
    bad = tmp_path / "lake"
    lu.write_lake(bad, tokens, routing)
    rows = tokens.filter((pl.col("run") == "b") & (pl.col("step") == 5) & (pl.col("sample") % lu.RANKS == 1))
    rows = rows.with_columns(trainer_logprob=pl.when(pl.int_range(pl.len()) == 3).then(0.5)
                             .otherwise(pl.col("trainer_logprob")))
    write_file(str(bad), "b", 5, "tokens", 1, rows.to_arrow())
    report = summarize(str(bad), tmp_path / "out", run="b", progress=False)
    assert report.refused == ["run=b/step=5: run=b/step=5/tokens-r00001.parquet: row 4, column 'trainer_logprob': "
                              "log-probability must be <= 0, got 0.5 (log-probs are natural-log probabilities of "
                              "the sampled token; drop untrained/padded tokens rather than writing placeholders)"]
    assert report.failed == [] and not report.ok
    steps = pq.read_table(tmp_path / "out" / "run=b" / "summary-summary_step.parquet").column("step").to_pylist()
    assert steps == [0]  # step 5 left out, step 0 summarised
    assert report.tokens == tokens.filter((pl.col("run") == "b") & (pl.col("step") == 0)).height


def test_token_sample_keeps_uniform_share_worst_sequences_and_top_tokens(seeded, tmp_path):
    lake, tokens, _, _ = seeded
    report = summarize(str(lake), tmp_path / "out", run="a", token_sample=0.3, progress=False)
    assert report.ok and report.partitions == 2
    folder = tmp_path / "out" / "run=a"
    kept = pq.read_table(folder / "tokens-sample.parquet")
    assert kept.schema.metadata[output.SUMMARISED_KEY.encode()] == b"1"
    record = pq.read_table(folder / "summary-token_samples.parquet").to_pylist()
    a = tokens.filter(pl.col("run") == "a").with_columns(d=pl.col("trainer_logprob") - pl.col("sampler_logprob"))
    for rec in record:
        mine = a.filter(pl.col("step") == rec["step"])
        got = pl.from_arrow(kept).filter(pl.col("step") == rec["step"])
        assert rec["n_tokens"] == mine.height and rec["n_kept"] == got.height
        assert 0 < rec["n_uniform"] < mine.height  # a share, neither none nor all
        # every token of the 16 worst sequences by |Σ Δ| (here: every sequence of the step) is kept
        worst = mine.group_by("sample").agg(pl.col("d").sum().abs()).sort("d", descending=True).head(16)
        assert rec["n_worst_sequence_tokens"] == mine.filter(pl.col("sample").is_in(worst["sample"].to_list())).height
        assert rec["n_top_tokens"] == min(256, mine.height)
        # kept rows are the logged rows, unchanged
        joined = got.join(mine, on=["sample", "pos"], suffix="_lake")
        assert joined.height == got.height
        assert (joined["trainer_logprob"] == joined["trainer_logprob_lake"]).all()
    routing = pq.read_table(folder / "routing-sample.parquet")
    assert routing.num_rows == kept.num_rows * 4  # every layer of each kept token


def test_summaries_only_by_default(seeded, tmp_path):
    lake, tokens, _, _ = seeded
    report = summarize(str(lake), tmp_path / "out", run="c", progress=False)
    names = sorted(p.name for p in (tmp_path / "out" / "run=c").iterdir())
    assert "tokens-sample.parquet" not in names and "summary-summary_step.parquet" in names
    record = pq.read_table(tmp_path / "out" / "run=c" / "summary-token_samples.parquet").to_pylist()
    assert [r["n_kept"] for r in record] == [0, 0]
    assert sum(r["n_tokens"] for r in record) == tokens.filter(pl.col("run") == "c").height == report.tokens
    meta = pq.read_schema(tmp_path / "out" / "run=c" / "summary-summary_layer.parquet").metadata
    assert meta[output.SUMMARY_KEY.encode()] == b"summary_layer"


def test_file_names_agree_with_driftlogger():
    pytest.importorskip("torch")
    from analysis import logger_summaries as ls
    from analysis.token_sample import Kept, SamplePlan
    assert (output.SUMMARY_KEY, output.SUMMARISED_KEY, output.SAMPLE_TABLE) == \
        (ls.SUMMARY_KEY, ls.SUMMARISED_KEY, ls.SAMPLE_TABLE)
    counts = dict(zip(output.SAMPLE_COUNTS, (10, 4, 2, 3, 1)))
    theirs = ls.sample_record("r", 7, Kept(**counts), SamplePlan(0.25))
    assert output.sample_records("r", [(7, counts)], 0.25).equals(theirs)


def test_unknown_engine_and_empty_lake_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no partitions"):
        summarize(str(tmp_path), tmp_path / "out", progress=False)
    write_file(str(tmp_path), "r", 0, "tokens", 0, lu.make_rows()[0].head(3).to_arrow())
    with pytest.raises(ValueError, match="engine"):
        summarize(str(tmp_path), tmp_path / "out", engine="spark", progress=False)
