"""distributions.*: counts against numpy binning of the same tokens; frames stay small."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.metrics import distributions


def _delta(tokens: pl.DataFrame) -> np.ndarray:
    return tokens["trainer_logprob"].to_numpy() - tokens["sampler_logprob"].to_numpy()


def _ref_counts(x: np.ndarray) -> dict[float, int]:
    """Tokens per display bin, keyed by the bin's lower edge: the bins [e_i, e_(i+1)) of the fixed global edges
    0, ±10^(j/10) for j = −80..30, binned by numpy (independent of the summaries' fine bins)."""
    mags = [10.0 ** (j / 10) for j in range(-80, 31)]
    edges = np.array(sorted({0.0} | set(mags) | {-m for m in mags}))
    b = np.searchsorted(edges, x, side="right")
    lower = np.concatenate([[edges[0] * 10 ** 0.1], edges])[b]
    return {float(k): int(v) for k, v in zip(*np.unique(lower, return_counts=True))}


def test_log_ratio_histogram_matches_numpy(metrics_data):
    store, data = metrics_data
    df = distributions.log_ratio_histogram(store, ["a", "b"])
    assert df.columns == ["run", "bin_lo", "bin_hi", "count", "frac"]
    for run in ("a", "b"):
        got = df.filter(pl.col("run") == run)
        d = _delta(data.tokens.filter(pl.col("run") == run))
        assert dict(zip(got["bin_lo"].to_list(), got["count"].to_list())) == _ref_counts(d)
        assert got["frac"].sum() == pytest.approx(1.0, rel=1e-12)
        assert (got["bin_lo"] < got["bin_hi"]).all()


def test_histogram_edges_are_global(metrics_data):
    # the same edges whatever the selection: a step range's bins are a subset of the whole run's
    store, _ = metrics_data
    whole = distributions.log_ratio_histogram(store, ["a"])
    part = distributions.log_ratio_histogram(store, ["a"], steps=(1, 1))
    assert set(part["bin_lo"]) <= set(whole["bin_lo"]) and part["count"].sum() < whole["count"].sum()


def test_ratio_histogram_is_log_binned(metrics_data):
    store, data = metrics_data
    df = distributions.ratio_histogram(store, ["a"])
    d = np.clip(_delta(data.tokens.filter(pl.col("run") == "a")), -20, 20)
    assert df["count"].sum() == len(d)
    want = {math.exp(k): v for k, v in _ref_counts(d).items()}  # bins of log r = clamp(Δ), edges in r units
    assert dict(zip(df["bin_lo"].to_list(), df["count"].to_list())) == want
    assert (df["bin_lo"] <= math.exp(d.max())).all() and df["bin_hi"].max() > math.exp(d.max())


def test_step_histogram_per_step_and_stride(metrics_data, monkeypatch):
    store, data = metrics_data
    df = distributions.step_histogram(store, "a")
    assert df.columns == ["step", "bin_lo", "bin_hi", "count", "frac"]
    counts = df.group_by("step").agg(pl.col("count").sum(), pl.col("frac").sum()).sort("step")
    want = data.tokens.filter(pl.col("run") == "a").group_by("step").len().sort("step")
    assert counts["count"].to_list() == want["len"].to_list()
    assert np.allclose(counts["frac"].to_numpy(), 1.0)
    for step in want["step"].to_list():  # each step's cells are numpy's binning of its tokens
        got = df.filter(pl.col("step") == step)
        d = _delta(data.tokens.filter((pl.col("run") == "a") & (pl.col("step") == step)))
        assert dict(zip(got["bin_lo"].to_list(), got["count"].to_list())) == _ref_counts(d)
    # 3 steps × N_DISPLAY_BINS cells > MAX_CELLS: merge steps in pairs
    monkeypatch.setattr(distributions, "MAX_CELLS", 3 * distributions.N_DISPLAY_BINS // 2)
    merged = distributions.step_histogram(store, "a")
    assert sorted(set(merged["step"])) == [0, 2]
    assert merged["count"].sum() == want["len"].sum()


def test_prob_density_2d_matches_numpy(metrics_data):
    store, data = metrics_data
    df = distributions.prob_density_2d(store, ["a", "b"], n_bins=8)
    assert df.columns == ["x_lo", "x_hi", "y_lo", "y_hi", "count"]
    x = np.exp(data.tokens["sampler_logprob"].to_numpy())
    y = np.exp(data.tokens["trainer_logprob"].to_numpy())
    bx = np.minimum(np.floor(x * 8), 7).astype(int)
    by = np.minimum(np.floor(y * 8), 7).astype(int)
    ref = {}
    for i, j in zip(bx, by):
        ref[(i, j)] = ref.get((i, j), 0) + 1
    got = {(round(r["x_lo"] * 8), round(r["y_lo"] * 8)): r["count"] for r in df.iter_rows(named=True)}
    assert got == ref and df.height <= 64


def test_thinned_prob_density_counts_the_chosen_steps_only(metrics_data, monkeypatch):
    from analysis.metrics import sampled
    store, data = metrics_data
    assert distributions.prob_density_2d(store, ["a"], n_bins=8, thin=True).equals(
        distributions.prob_density_2d(store, ["a"], n_bins=8))  # small: every step
    monkeypatch.setattr(sampled, "THIN_TOKENS", 1)
    th = sampled.thin_steps(store, ["a"], [None], budget=1)
    assert th.steps is not None and len(th.steps) >= 1
    got = distributions.prob_density_2d(store, ["a"], n_bins=8, thin=True)
    tok = data.tokens.filter((pl.col("run") == "a") & pl.col("step").is_in(list(th.steps)))
    assert got["count"].sum() == tok.height == th.n_read
    from analysis.metrics import buckets  # the top token ids read the same steps
    top = buckets.top_tokens(store, "a", n=1000, min_count=1, thin=True, order="n_tokens")
    assert top["n_tokens"].sum() == tok.filter(pl.col("token_id").is_not_null() | pl.col("token").is_not_null()).height


def test_empty_selection_gives_empty_frames(metrics_data):
    store, _ = metrics_data
    assert distributions.log_ratio_histogram(store, ["a"], steps=(9, 9)).height == 0
    assert distributions.ratio_histogram(store, ["nope"]).height == 0
    assert distributions.step_histogram(store, "a", steps=(9, 9)).height == 0
    assert distributions.prob_density_2d(store, ["a"], steps=(9, 9)).height == 0


def test_identical_logprobs_fall_in_one_bin(metrics_store_from):
    s = [-0.1, -1.0, -3.0]
    tokens = pl.DataFrame({"run": ["e"] * 3, "step": [0] * 3, "sample": [0] * 3, "pos": [0, 1, 2],
                           "sampler_logprob": s, "trainer_logprob": s})
    store = metrics_store_from(tokens)
    df = distributions.log_ratio_histogram(store, ["e"])
    assert df["count"].to_list() == [3] and df["bin_lo"][0] == 0.0 < df["bin_hi"][0] == 1e-8


def _bundle_matches(store, runs, n_bins, steps=None):
    from analysis.metrics import token as metrics
    got = distributions.drift_histograms(store, runs, n_bins=n_bins, steps=steps)
    want = {"log_ratio": distributions.log_ratio_histogram(store, runs, n_bins=n_bins, steps=steps),
            "ratio": distributions.ratio_histogram(store, runs, n_bins=n_bins, steps=steps),
            "extreme": metrics.extreme_token_curve(store, runs, steps=steps)}
    assert got.keys() == want.keys()
    for key in want:  # the same frames, value for value (counts are integers; edges the same arithmetic)
        assert got[key].schema == want[key].schema, key
        assert got[key].equals(want[key]), key


@pytest.mark.parametrize("runs, n_bins, steps", [(["a", "b"], 25, None), (["b"], 80, (1, 2)), (["a"], 1, None),
                                                  (["a"], 40, (9, 9)), ([], 10, None)])
def test_drift_histograms_equal_the_separate_functions(metrics_data, runs, n_bins, steps):
    store, _ = metrics_data
    _bundle_matches(store, runs, n_bins, steps)


def test_drift_histograms_on_identical_logprobs(metrics_store_from):
    s = [-0.1, -1.0, -3.0]
    tokens = pl.DataFrame({"run": ["e"] * 3, "step": [0] * 3, "sample": [0] * 3, "pos": [0, 1, 2],
                           "sampler_logprob": s, "trainer_logprob": s})
    _bundle_matches(metrics_store_from(tokens), ["e"], 80)
