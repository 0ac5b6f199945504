"""`summarize` of a seeded lake on the in-process engine: its summaries equal those of ingesting every token
(counts exactly, sums at rel 1e-12), a partition that breaks SCHEMA.md is reported while the others complete,
the token sample keeps what DriftLogger keeps, and the files carry DriftLogger's names."""
from __future__ import annotations

import io
from contextlib import redirect_stdout

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from analysis.__main__ import main
from analysis.ingest import ingest_paths
from analysis.lake import partial
from analysis.lake.engines import run_local
from analysis.lake.layout import list_partitions, write_file
from analysis.lake.summarize import summarize
from analysis.metrics import buckets, report
from analysis.metrics import token as metrics
from analysis.store import Store
from analysis.summaries import schema as S

from helpers import ROOT
from helpers import browser as bu
from helpers import lake as lu
from helpers.data import metrics_make_tokens


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
    merged = {t: partial.merge(t, [r.tables[t] for r in results]) for t in direct}  # what ingest computes
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
    steps = [r["step"] for r in _summary_rows(tmp_path / "out" / "run=b", "summary_step")]
    assert steps == [0]  # step 5 left out, step 0 summarised
    assert report.tokens == tokens.filter((pl.col("run") == "b") & (pl.col("step") == 0)).height


def test_token_sample_keeps_uniform_share_worst_sequences_and_top_tokens(seeded, tmp_path):
    lake, tokens, _, _ = seeded
    report = summarize(str(lake), tmp_path / "out", run="a", token_sample=0.3, progress=False)
    assert report.ok and report.partitions == 2
    folder = tmp_path / "out" / "run=a"
    kept = pq.read_table(folder / "tokens-sample.parquet")
    assert kept.schema.metadata[S.SUMMARISED_KEY] == S.SUMMARISED_VALUE
    record = _summary_rows(folder, "summary_sample")
    a = tokens.filter(pl.col("run") == "a").with_columns(d=pl.col("trainer_logprob") - pl.col("sampler_logprob"))
    for rec in record:
        mine = a.filter(pl.col("step") == rec["step"])
        got = pl.from_arrow(kept).filter(pl.col("step") == rec["step"])
        assert rec["n_tokens"] == mine.height and rec["n_kept"] == got.height
        assert 0 < rec["n_uniform"] < mine.height  # a share, neither none nor all
        # every token of the worst sequences by |Σ Δ| is kept
        worst = mine.group_by("sample").agg(pl.col("d").sum().abs()).sort("d", descending=True)
        worst = worst.head(partial.WORST_SEQUENCES)
        assert rec["n_worst_seq_tokens"] == mine.filter(pl.col("sample").is_in(worst["sample"].to_list())).height
        assert rec["n_top_tokens"] == min(256, mine.height)
        # kept rows are the logged rows, unchanged
        joined = got.join(mine, on=["sample", "pos"], suffix="_lake")
        assert joined.height == got.height
        assert (joined["trainer_logprob"] == joined["trainer_logprob_lake"]).all()
    routing = pq.read_table(folder / "routing-sample.parquet")
    assert routing.num_rows == kept.num_rows * 4  # every layer of each kept token


def _summary_rows(folder, table: str) -> list[dict]:
    return lu.read_summary_file(folder / "summary.parquet")[table].to_pylist()


def test_summaries_only_by_default(seeded, tmp_path):
    lake, tokens, _, _ = seeded
    report = summarize(str(lake), tmp_path / "out", run="c", progress=False)
    names = sorted(p.name for p in (tmp_path / "out" / "run=c").iterdir())
    assert names == ["run.json", "summary.parquet"]
    record = _summary_rows(tmp_path / "out" / "run=c", "summary_sample")
    assert [r["n_kept"] for r in record] == [0, 0]
    assert sum(r["n_tokens"] for r in record) == tokens.filter(pl.col("run") == "c").height == report.tokens


def test_summary_file_reads_back_as_written(seeded, tmp_path):
    lake, _, _, direct = seeded
    summarize(str(lake), tmp_path / "out", run="a", progress=False)
    back = lu.read_summary_file(tmp_path / "out" / "run=a" / "summary.parquet")
    lu.assert_same_summaries(lu.of_run(back, "a", only=direct), lu.of_run(direct, "a"))


def test_ingested_summaries_give_the_token_level_metrics(seeded, tmp_path):
    """summarize -> ingest: the database holds no token rows, and metrics --by step|run equal the token-level
    computation on the database that ingested every token (and numpy), --by layer its routing columns."""
    lake, tokens, _, _ = seeded
    assert main(["summarize", str(lake), "--out", str(tmp_path / "out")]) == 0
    assert main(["ingest", str(tmp_path / "out"), "--db", str(tmp_path / "s.duckdb")]) == 0
    summaries_only = Store(tmp_path / "s.duckdb", read_only=True)
    direct = Store(lake.parent / "direct.duckdb", read_only=True)
    try:
        assert summaries_only.scalar("SELECT count(*) FROM tokens") == 0
        runs = ["a", "b", "c"]
        for by in ("step", "run"):
            got = report.metrics_table(summaries_only, runs, by=by)
            want = metrics.token_metrics(direct, runs, by=by)
            keys = ["run", "step"] if by == "step" else ["run"]
            lu.assert_same_frames(got.select(want.columns).sort(keys), want.sort(keys))
        lu.assert_same_frames(report.metrics_table(summaries_only, runs, by="layer"),
                              report.metrics_table(direct, runs, by="layer"))
        # bucket tables and their cap/clip columns (the *_band tables); the seeded lake has no tags nor turns
        for dim in (d for d in buckets.DIMENSIONS if d not in ("tag", "segment")):
            chosen = None if dim == "length" else ["n_tokens", "kl_k3", "ratio_frac_high", "clip_frac", "ess"]
            got = buckets.mismatch_by(summaries_only, runs, dim, cap=1.5, clip=0.1, metrics=chosen)
            lu.assert_same_frames(got, buckets.mismatch_by(direct, runs, dim, cap=1.5, clip=0.1, metrics=chosen))
    finally:
        summaries_only.close()
        direct.close()
    d = tokens.with_columns(d=pl.col("trainer_logprob") - pl.col("sampler_logprob"))
    ref = d.group_by("run").agg(n=pl.len(), k1=(-pl.col("d")).mean()).sort("run")
    got = pl.read_csv(_cli_csv(["metrics", "--db", str(tmp_path / "s.duckdb"), "--by", "run"]))
    assert got["n_tokens"].to_list() == ref["n"].to_list()
    np.testing.assert_allclose(got["kl_k1"].to_numpy(), ref["k1"].to_numpy(), rtol=1e-12)


def test_sample_sizes_are_driftloggers_defaults():
    token_sample = pytest.importorskip("analysis.record.token_sample")  # needs torch
    assert (partial.WORST_SEQUENCES, partial.TOP_TOKENS) == (token_sample.WORST_SEQUENCES, token_sample.TOP_TOKENS)


def test_unknown_engine_and_empty_lake_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="no partitions"):
        summarize(str(tmp_path), tmp_path / "out", progress=False)
    write_file(str(tmp_path), "r", 0, "tokens", 0, lu.make_rows()[0].head(3).to_arrow())
    with pytest.raises(ValueError, match="engine"):
        summarize(str(tmp_path), tmp_path / "out", engine="spark", progress=False)


def _cli_csv(argv: list[str]) -> io.StringIO:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(argv) == 0
    out.seek(0)
    return out


def test_the_app_shows_a_summarized_lake(tmp_path, monkeypatch):
    """The app opens on a database that holds only summarize's files: the overview draws its curves, and the
    token-level views say they read a sample and what it holds (40 sequences: more than the 4 kept whole)."""
    from streamlit.testing.v1 import AppTest

    from analysis.metrics import sampled

    tokens = metrics_make_tokens(seed=5, runs=("s",), steps=(3,), n_seq=40, max_len=30)
    write_file(str(tmp_path / "lake"), "s", 3, "tokens", 0, tokens.to_arrow())
    assert main(["summarize", str(tmp_path / "lake"), "--out", str(tmp_path / "out"), "--token-sample", "0.1"]) == 0
    assert main(["ingest", str(tmp_path / "out"), "--db", str(tmp_path / "s.duckdb")]) == 0
    store = Store(tmp_path / "s.duckdb", read_only=True)
    kept = store.scalar("SELECT count(*) FROM tokens")
    assert 0 < kept < tokens.height
    assert sampled.sample_label(store, ["s"]) == (
        f"tokens: {sampled.share_text(kept / tokens.height)} sample ({kept} of {tokens.height}); curves are exact"
        " — a uniform 10% draw, plus per step the worst sequence by |ΣΔ| and the 256 tokens of largest |Δ|")
    store.close()
    monkeypatch.setenv("DRIFT_DB", str(tmp_path / "s.duckdb"))
    monkeypatch.setenv("DRIFT_NO_DEMO", "1")
    monkeypatch.setenv("DRIFT_PREFETCH", "0")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=120)
    at.run()
    assert not at.exception, at.exception
    assert not at.error, [e.value for e in at.error]
    assert at.multiselect(key="sidebar_runs").value == ["s"]
    assert bu.app_charts(at) > 0
