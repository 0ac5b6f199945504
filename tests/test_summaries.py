"""Summaries (analysis/summaries/): every METRICS.md v2 column finalised from the summaries equals a
high-precision numpy reference written from the definitions and the token-level SQL, at rel 1e-12; merging
partial summaries of several files equals summarising one file; the fixed-edge bins count exactly."""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import polars as pl
import pytest

from analysis.ingest import ingest_paths, open_store
from analysis.metrics import buckets, distributions, read, report
from analysis.metrics import token as metrics
from analysis.store import Store
from analysis.summaries import finalise as F
from analysis.summaries import schema as S

from helpers.data import load_files, metrics_make_routing, metrics_make_tokens, write_parquet
from helpers.reference import assert_frames_close, ref_routing_by_layer, ref_token_flips

L = np.longdouble  # 64-bit mantissa on x86: the reference carries 3 more digits than the code under test
RTOL = 1e-12


def ref_v2(s: np.ndarray, t: np.ndarray, seq: list, cap: float, clip: float) -> dict:
    """METRICS.md v2 token columns of one group, from the definitions, in extended precision."""
    s64, t64 = np.asarray(s, float), np.asarray(t, float)
    d = (t64 - s64).astype(L)  # Δ as the database stores it (one float64 subtraction), then extended
    s, t = s64.astype(L), t64.astype(L)
    cd = np.clip(d, -20, 20)
    r = np.exp(cd)
    ps, pt = np.exp(s), np.exp(t)
    n = len(d)
    mean = lambda x: np.sum(x) / n

    def centred(a, b):
        return np.sum((a - mean(a)) * (b - mean(b)))
    constant = np.all(ps == ps[0]) or np.all(pt == pt[0])
    w = np.clip(r, L(1) / L(cap), L(cap))
    out = {
        "n_tokens": n, "kl_k1": mean(s - t), "kl_k2": mean(d * d / 2), "kl_k3": mean(np.expm1(cd) - d),
        "log_ratio_abs_mean": mean(np.abs(d)), "log_ratio_abs_max": np.max(np.abs(d)),
        "prob_abs_diff_mean": mean(np.abs(pt - ps)), "prob_abs_diff_max": np.max(np.abs(pt - ps)),
        "prob_pearson": None if n < 2 or constant else centred(pt, ps) / np.sqrt(centred(pt, pt) * centred(ps, ps)),
        "ratio_mean": mean(r), "ratio_std": np.sqrt(mean((r - mean(r)) ** 2)), "ratio_min": np.min(r),
        "ratio_max": np.max(r), "chi2_token": mean(np.expm1(cd) ** 2) + 2 * mean(np.expm1(cd)),
        "ratio_frac_high": mean(r > cap), "ratio_frac_low": mean(r < 1.0 / cap),
        "clip_frac": mean(np.abs(r - 1) > clip),
        "ess": 1.0 if np.all(w == w[0]) else mean(w) ** 2 / mean(w * w),
        "mult_prob_error": mean(np.exp(np.abs(cd))), "kl_k3_reverse": mean(np.expm1(-cd) + d),
    }
    by_seq = defaultdict(list)
    for i, key in enumerate(seq):
        by_seq[key].append(i)
    sums = [np.sum(d[ix]) for ix in by_seq.values()]
    lens = [len(ix) for ix in by_seq.values()]
    geo = [np.exp(x / k) for x, k in zip(sums, lens)]
    out.update(n_sequences=len(sums),
               ppl_ratio=np.mean([np.exp(-x / k) for x, k in zip(sums, lens)]),
               chi2_seq=np.mean([np.expm1(2 * np.clip(x, -20, 20)) for x in sums]),
               seq_log_ratio_abs_max=max(abs(x) for x in sums),
               seq_geo_ratio_mean=np.mean(geo), seq_geo_ratio_min=min(geo), seq_geo_ratio_max=max(geo))
    return {k: (None if v is None else float(v)) for k, v in out.items()}


def ref_table(tokens: pl.DataFrame, keys: list[str], cap: float, clip: float) -> dict[tuple, dict]:
    out = {}
    for key, g in tokens.group_by(keys, maintain_order=True):
        seq = list(zip(g["run"], g["step"], g["sample"]))
        out[tuple(key)] = ref_v2(g["sampler_logprob"].to_numpy(), g["trainer_logprob"].to_numpy(), seq, cap, clip)
    return out


def ref_flips(routing: pl.DataFrame, keys: list[str]) -> dict[tuple, dict]:
    """token_any_flip_rate and flipped_layers_per_token per group, over tokens with trainer routing."""
    groups = defaultdict(list)
    for (run, step, _s, _p), (anyf, nf, _first) in ref_token_flips(routing).items():
        groups[(run, step) if keys == ["run", "step"] else (run,)].append((anyf, nf))
    return {k: {"token_any_flip_rate": float(np.mean([a for a, _ in v])),
                "flipped_layers_per_token": float(np.mean([n for _, n in v]))} for k, v in groups.items()}


def close(got, want, what: str, scale: float = 0.0) -> None:
    """rel 1e-12; `scale` (the size of the terms summed) allows the absolute rounding of a mean that cancels
    (kl_k1 ≈ 0 from terms of either sign): 1e-15 × scale."""
    if want is None:
        assert got is None, f"{what}: expected null, got {got}"
        return
    assert got is not None, f"{what}: expected {want}, got null"
    assert math.isclose(got, want, rel_tol=RTOL, abs_tol=1e-15 * scale), f"{what}: got {got!r}, expected {want!r}"


def assert_table(df: pl.DataFrame, ref: dict[tuple, dict], keys: list[str], scale: dict[tuple, float]) -> None:
    assert df.height == len(ref), (df.height, len(ref))
    for row in df.iter_rows(named=True):
        key = tuple(row[k] for k in keys)
        for col, want in ref[key].items():
            close(row[col], want, f"{key} {col}", scale[key] if col in ("kl_k1",) else 0.0)


def _abs_scale(tokens: pl.DataFrame, keys: list[str]) -> dict[tuple, float]:
    g = tokens.group_by(keys).agg((pl.col("trainer_logprob") - pl.col("sampler_logprob")).abs().mean().alias("m"))
    return {tuple(r[k] for k in keys): r["m"] for r in g.iter_rows(named=True)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Runs a and b: routing of both sides, staleness (sampler_version lags 0–2), heavy tails; run c: sampler-side
    routing only. Loaded as one tokens and one routing file per run."""
    tokens = metrics_make_tokens(seed=101, runs=("a", "b", "c"), steps=(0, 1, 2, 3), n_seq=6, max_len=30)
    both = metrics_make_routing(tokens.filter(pl.col("run") != "c"), seed=102, layers=4)
    sampler_only = metrics_make_routing(tokens.filter(pl.col("run") == "c"), seed=103, layers=4, trainer=False)
    tmp = tmp_path_factory.mktemp("summaries")
    store = load_files(tmp, "one", [("tokens.parquet", tokens), ("routing_ab.parquet", both),
                               ("routing_c.parquet", sampler_only)])
    yield store, tokens, both, pl.concat([both, sampler_only.with_columns(
        trainer_experts=pl.lit(None, pl.List(pl.Int32)))])
    store.close()


@pytest.mark.parametrize("cap, clip", [(2.0, 0.2), (1.5, 0.28), (10.0, 0.5)])
@pytest.mark.parametrize("by", ["step", "run"])
def test_token_columns_match_numpy_and_token_sql(data, by, cap, clip):
    store, tokens, both, _ = data
    keys = ["run", "step"] if by == "step" else ["run"]
    df = report.metrics_table(store, ["a", "b", "c"], by=by, cap=cap, clip=clip)
    assert df.columns == keys + list(metrics.TOKEN_METRICS) + list(metrics.CHECK_METRICS) + list(
        metrics.RESIDUAL_METRICS) + list(F.TOPK_COLUMNS) + ["token_any_flip_rate", "flipped_layers_per_token"]
    assert all(df[c].null_count() == len(df) for c in F.TOPK_COLUMNS)  # no top-k logged here
    assert_table(df, ref_table(tokens, keys, cap, clip), keys, _abs_scale(tokens, keys))
    # the token-level SQL (the drill-down path) gives the same numbers
    sql = metrics.token_metrics(store, ["a", "b", "c"], by=by, cap=cap, clip=clip)
    assert sql.select(keys).equals(df.select(keys))
    for col in metrics.TOKEN_METRICS:
        for key, x, y in zip(df.select(keys).rows(), df[col].to_list(), sql[col].to_list()):
            close(x, y, f"{key} {col} (token SQL)", _abs_scale(tokens, keys)[key] if col == "kl_k1" else 0.0)
    flips = ref_flips(both, keys)
    for row in df.iter_rows(named=True):
        key = tuple(row[k] for k in keys)
        if row["run"] == "c":  # sampler-side routing only: no flip columns
            assert row["token_any_flip_rate"] is None and row["flipped_layers_per_token"] is None
        else:
            for col, want in flips[key].items():
                close(row[col], want, f"{key} {col}")


def test_layer_columns_match_numpy(data):
    store, _, _, routing = data
    df = report.metrics_table(store, ["a", "b", "c"], by="layer")
    ref = ref_routing_by_layer(routing)
    assert df.height == len(ref)
    for row in df.iter_rows(named=True):
        key = (row["run"], row["step"], row["layer"])
        for col, want in ref[key].items():
            close(row[col], want, f"{key} {col}")
    assert (df.filter(pl.col("run") == "c")["n_tokens"] == 0).all()


def test_routing_views_match_numpy(data):
    from analysis.metrics import routing as R
    store, _, both, _ = data
    per_token = ref_token_flips(both)
    views = R.flip_views(store, ["a", "b", "c"], views=("step", "run", "first_flip", "mismatch"))
    for by, keys in (("step", ["run", "step"]), ("run", ["run"])):
        ref = ref_flips(both, keys)
        assert views[by].height == len(ref)
        for row in views[by].iter_rows(named=True):
            for col, want in ref[tuple(row[k] for k in keys)].items():
                close(row[col], want, col)
    first = defaultdict(lambda: defaultdict(int))
    for (run, *_), (_, _, f) in per_token.items():
        if f is not None:
            first[run][f] += 1
    got = {(r["run"], r["first_flip_layer"]): r["n_tokens"] for r in views["first_flip"].iter_rows(named=True)}
    assert got == {(run, layer): n for run, c in first.items() for layer, n in c.items()}
    # flipped vs unflipped: mean |Δ| and kl_k3 of each group
    d = {k: v for k, v in zip(data[1].select("run", "step", "sample", "pos").rows(),
                              (data[1]["trainer_logprob"] - data[1]["sampler_logprob"]).to_list())}
    for row in views["mismatch"].iter_rows(named=True):
        ds = np.array([d[k] for k, (a, _, _) in per_token.items() if k[0] == row["run"] and a == row["flipped"]],
                      dtype=L)
        assert row["n_tokens"] == len(ds)
        close(row["log_ratio_abs_mean"], float(np.mean(np.abs(ds))), "abs")
        close(row["kl_k3"], float(np.mean(np.expm1(np.clip(ds, -20, 20)) - ds)), "k3")


def test_identical_logprobs_single_token_and_empty_range(tmp_path):
    s = [-0.1, -1.0, -3.0, -0.5]
    same = pl.DataFrame({"run": ["e"] * 4, "step": [0, 0, 0, 1], "sample": [0, 0, 1, 0], "pos": [0, 1, 0, 0],
                         "sampler_logprob": s, "trainer_logprob": s})
    store = load_files(tmp_path, "same", [("t.parquet", same)])
    for by in ("step", "run"):
        for row in report.metrics_table(store, ["e"], by=by).iter_rows(named=True):
            for col in ("kl_k1", "kl_k2", "kl_k3", "kl_k3_reverse", "log_ratio_abs_mean", "log_ratio_abs_max",
                        "prob_abs_diff_mean", "prob_abs_diff_max", "ratio_std", "chi2_token", "ratio_frac_high",
                        "ratio_frac_low", "clip_frac", "chi2_seq", "seq_log_ratio_abs_max"):
                assert row[col] == 0.0, (by, col, row[col])
            for col in ("ratio_mean", "ratio_min", "ratio_max", "ess", "ppl_ratio", "mult_prob_error",
                        "seq_geo_ratio_mean", "seq_geo_ratio_min", "seq_geo_ratio_max"):
                assert row[col] == 1.0, (by, col, row[col])
    one = report.metrics_table(store, ["e"], by="step").filter(pl.col("step") == 1).row(0, named=True)
    assert one["n_tokens"] == 1 and one["n_sequences"] == 1 and one["prob_pearson"] is None
    assert report.metrics_table(store, ["e"], by="step", steps=(5, 9)).height == 0  # empty step: no row
    assert report.metrics_table(store, ["e"], by="run", steps=(5, 9)).height == 0
    store.close()


def _summary_rows(store: Store, table: str) -> pl.DataFrame:
    """A summary table merged over files per its key (what any finalisation reads)."""
    keys = [c for c in S.columns(table) if S.merge_kind(c) == "key" and c != "file_id"]
    agg = [(pl.col(c).sum() if S.merge_kind(c) == "sum" else pl.col(c).min() if S.merge_kind(c) == "min"
            else pl.col(c).max()).alias(c) for c in S.columns(table) if S.merge_kind(c) != "key"]
    return store.sql(f"SELECT * FROM {table}").group_by(keys).agg(agg).sort(keys)


def test_a_step_split_across_files_equals_one_file(tmp_path, data):
    _, tokens, both, _ = data
    tokens, both = tokens.filter(pl.col("run") != "c"), both
    # split every step by sequence into three files, and one sequence's tokens across two of them (by position);
    # routing split by token over two files (all of a token's layers in one)
    part = (pl.col("sample") % 3)
    split_seq = (pl.col("sample") == 1) & (pl.col("pos") >= 3)
    files = [(f"tokens{i}.parquet", tokens.filter(((part == i) & ~split_seq) | (split_seq if i == 2 else pl.lit(False))))
             for i in range(3)]
    rfiles = [(f"routing{i}.parquet", both.filter((pl.col("pos") % 2) == i)) for i in range(2)]
    one = load_files(tmp_path, "whole", [("tokens.parquet", tokens), ("routing.parquet", both)])
    many = load_files(tmp_path, "split", files + rfiles)
    for table in ("summary_step", "summary_seq", "summary_seq_band", "summary_hist", "summary_bucket",
                  "summary_bucket_band", "summary_layer"):
        a, b = _summary_rows(one, table), _summary_rows(many, table)
        assert a.select(pl.col(pl.Int64, pl.Int32, pl.Int16, pl.String)).equals(
            b.select(pl.col(pl.Int64, pl.Int32, pl.Int16, pl.String))), table
        for col in a.select(pl.col(pl.Float64)).columns:
            assert np.allclose(a[col].to_numpy(), b[col].to_numpy(), rtol=1e-13, atol=0, equal_nan=True), (table, col)
    assert many.scalar("SELECT count(DISTINCT file_id) FROM summary_step") == 5
    for by in ("step", "run", "layer"):
        assert_frames_close(report.metrics_table(one, ["a", "b"], by=by), report.metrics_table(many, ["a", "b"], by=by))
    one.close()
    many.close()


def test_fine_bins_count_values_on_the_edges_exactly(tmp_path):
    # Δ exactly on every threshold edge (ln C, ln(1 ± ε), 0, ±20) and just beside it: strict and non-strict
    # comparisons at the edges must match the token SQL and numpy
    edges = list(S.BAND_EDGES)
    d = []
    for e in edges:
        d += [e, math.nextafter(e, -math.inf), math.nextafter(e, math.inf)]
    d = np.array(d)
    s = np.where(d > 0, -d, 0.0)  # t − s == d exactly: one side is 0
    t = np.where(d > 0, 0.0, d)
    assert np.array_equal(t - s, d)
    toks = pl.DataFrame({"run": "x", "step": 0, "sample": np.arange(len(d)) // 5, "pos": np.arange(len(d)) % 5,
                         "sampler_logprob": s, "trainer_logprob": t})
    store = load_files(tmp_path, "edges", [("t.parquet", toks)])
    hist = store.sql("SELECT bin, sum(n_tokens)::BIGINT AS n FROM summary_hist GROUP BY bin ORDER BY bin")
    E = np.array(S.D_EDGES)
    k = np.searchsorted(E, d, side="left")  # #{E < d}
    on = np.array([k_ < len(E) and E[k_] == x for k_, x in zip(k, d)])
    want = defaultdict(int)
    for b in 2 * k + on:
        want[int(b)] += 1
    assert dict(zip(hist["bin"].to_list(), hist["n"].to_list())) == dict(want)
    for cap in S.CAPS:
        for clip in S.CLIPS:
            a = report.metrics_table(store, ["x"], by="run", cap=cap, clip=clip).row(0, named=True)
            b = metrics.token_metrics(store, ["x"], by="run", cap=cap, clip=clip).row(0, named=True)
            for col in ("ratio_frac_high", "ratio_frac_low", "clip_frac"):
                assert a[col] == b[col], (cap, clip, col)
            assert a["ratio_frac_high"] == np.mean(d > math.log(cap))
            assert a["clip_frac"] == np.mean((d > math.log1p(clip)) | (d < math.log1p(-clip)))
            close(a["ess"], b["ess"], "ess")
    store.close()


def test_buckets_and_histograms_from_summaries_equal_token_binning(data):
    store, tokens, _, _ = data
    for dim in buckets.DIMENSIONS:
        chosen = None if dim == "length" else [m for m in metrics.TOKEN_METRICS
                                               if m not in metrics.SEQUENCE_METRICS + ("n_sequences",)]
        got = buckets.mismatch_by(store, ["a", "b"], dim, metrics=chosen)
        want = buckets.mismatch_by_tokens(store, ["a", "b"], dim, metrics=chosen)
        assert got.columns == want.columns and got.select("run", "bucket", "label").equals(
            want.select("run", "bucket", "label")), dim
        for col in want.columns[5:]:
            for x, y in zip(got[col].to_list(), want[col].to_list()):
                assert (x is None and y is None) or math.isclose(x, y, rel_tol=RTOL, abs_tol=1e-15), (dim, col)
    # F(τ) from the summaries' Δ bins equals the token rows' count
    bundle = distributions.drift_histograms(store, ["a", "b", "c"])
    assert bundle["extreme"].equals(metrics.extreme_token_curve(store, ["a", "b", "c"]))


def test_other_cap_falls_back_to_token_rows(data):
    store, tokens, _, _ = data
    got = report.metrics_table(store, ["a"], by="step", cap=1.7, clip=0.15)
    want = metrics.token_metrics(store, ["a"], by="step", cap=1.7, clip=0.15)
    # the same SQL over the token rows, twice: DuckDB's parallel GROUP BY may add a step's per-sequence terms
    # in another order from one query to the next (an ulp of ppl_ratio or chi2_seq), so close, not equal
    # plus the top-k columns, which come from the summaries whatever C and ε (null here: no top-k logged)
    assert_frames_close(got.drop("token_any_flip_rate", "flipped_layers_per_token", *F.TOPK_COLUMNS), want)


def test_routing_layers_of_a_token_in_two_files_are_refused(tmp_path, data):
    _, tokens, both, _ = data
    tok = tokens.filter((pl.col("run") == "a") & (pl.col("step") == 0))
    rt = both.filter((pl.col("run") == "a") & (pl.col("step") == 0))
    folder = tmp_path / "split_layers"
    folder.mkdir()
    write_parquet(folder / "t.parquet", tok)
    write_parquet(folder / "r1.parquet", rt.filter(pl.col("layer") < 2))
    write_parquet(folder / "r2.parquet", rt.filter(pl.col("layer") >= 2))
    store = Store(tmp_path / "sl.duckdb")
    out = {o.name: o for o in ingest_paths(store, [folder / "t.parquet", folder / "r1.parquet"])}
    assert all(o.status == "loaded" for o in out.values())
    before = store.scalar("SELECT count(*) FROM summary_layer")
    o = ingest_paths(store, [folder / "r2.parquet"])[0]
    assert o.status == "refused" and "other layers of this token were already loaded" in o.message
    assert "r2.parquet" in o.message and "write all MoE layers of a token in one routing file" in o.message
    assert store.scalar("SELECT count(*) FROM routing WHERE layer >= 2") == 0
    assert store.scalar("SELECT count(*) FROM summary_layer") == before  # nothing of the refused file
    store.close()


def test_summarised_token_files_are_stored_but_not_summarised_again(tmp_path, data):
    _, tokens, _, _ = data
    tok = tokens.filter(pl.col("run") == "a")
    folder = tmp_path / "flagged"
    folder.mkdir()
    write_parquet(folder / "sample.parquet", tok, {S.SUMMARISED_KEY: S.SUMMARISED_VALUE})
    store = Store(tmp_path / "f.duckdb")
    assert ingest_paths(store, [folder / "sample.parquet"])[0].status == "loaded"
    assert store.scalar("SELECT count(*) FROM tokens") == tok.height
    assert store.scalar("SELECT count(*) FROM summary_step") == 0
    assert store.scalar("SELECT count(*) FROM summary_skip") == 1
    store.close()


def test_runs_coverage_and_delete_run(tmp_path, data):
    _, tokens, both, _ = data
    store = load_files(tmp_path, "cov", [("t.parquet", tokens.filter(pl.col("run") != "c")), ("r.parquet", both)])
    runs = store.runs()
    want = tokens.filter(pl.col("run") != "c").group_by("run").agg(
        n_tokens=pl.len(), n_steps=pl.col("step").n_unique(),
        n_sequences=pl.struct("step", "sample").n_unique()).sort("run")
    assert runs.select("run", "n_tokens", "n_steps", "n_sequences").sort("run").equals(
        want.cast({"n_tokens": pl.Int64, "n_steps": pl.Int64, "n_sequences": pl.Int64}))
    cov = read.coverage(store)
    assert cov["complete"].to_list() == [True, True]
    store.delete_run("a")
    for table in S.TABLES:
        # summary_sample: DriftLogger files only; summary_margin: runs with router margins (test_margins.py)
        if "run" in S.columns(table) and table not in ("summary_sample", "summary_margin"):
            assert store.scalar(f"SELECT count(*) FROM {table} WHERE run = 'a'") == 0, table
            assert store.scalar(f"SELECT count(*) FROM {table} WHERE run = 'b'") > 0, table
    store.close()


@pytest.mark.parametrize("where", ["near 0", "near 1"])
def test_pearson_keeps_its_digits_whether_probabilities_sit_near_0_or_1(tmp_path, where):
    # moments around p = 1 lose ~4 digits when p ≈ 0.005 (and those around 0 when p ≈ 0.995): finalise picks
    # the pair whose mean is nearer 0
    rng = np.random.default_rng(5)
    n = 2000
    s = -6.0 + rng.normal(0, 0.3, n) if where == "near 0" else -rng.exponential(0.005, n)
    t = np.minimum(s + rng.normal(0, 1e-3, n), 0.0)
    toks = pl.DataFrame({"run": "p", "step": 0, "sample": np.arange(n) // 50, "pos": np.arange(n) % 50,
                         "sampler_logprob": s, "trainer_logprob": t})
    store = load_files(tmp_path, "pearson", [("t.parquet", toks)])
    got = report.metrics_table(store, ["p"], by="run").row(0, named=True)["prob_pearson"]
    want = ref_v2(s, t, list(toks["sample"]), 2.0, 0.2)["prob_pearson"]
    assert 0.9 < want < 1.0
    close(got, want, "prob_pearson")
    store.close()


def test_a_database_loaded_before_summaries_is_summarised_when_opened(tmp_path, data):
    _, tokens, both, _ = data
    tok, rt = tokens.filter(pl.col("run") == "a"), both.filter(pl.col("run") == "a")
    store = load_files(tmp_path, "legacy", [("t.parquet", tok), ("r.parquet", rt)])
    want = {by: report.metrics_table(store, ["a"], by=by) for by in ("step", "run", "layer")}
    for table in S.TABLES:  # as a database written before summaries existed
        store.cursor().execute(f"DELETE FROM {table}")
    assert report.metrics_table(store, ["a"], by="run").height == 0
    store.close()
    store = open_store(tmp_path / "legacy.duckdb")
    for by, df in want.items():
        assert_frames_close(report.metrics_table(store, ["a"], by=by), df)
    store.close()

