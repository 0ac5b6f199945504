"""distributions.*: counts against numpy binning of the same tokens; frames stay small."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis import distributions


def _delta(tokens: pl.DataFrame) -> np.ndarray:
    return tokens["trainer_logprob"].to_numpy() - tokens["sampler_logprob"].to_numpy()


def _ref_counts(x: np.ndarray, lo: float, hi: float, n_bins: int) -> dict[int, int]:
    width = (hi - lo) / n_bins
    inside = x[(x >= lo) & (x <= hi)]
    b = np.minimum(np.floor((inside - lo) / width), n_bins - 1).astype(int)
    return {int(k): int(v) for k, v in zip(*np.unique(b, return_counts=True))}


def test_log_ratio_histogram_matches_numpy(metrics_data):
    store, data = metrics_data
    df = distributions.log_ratio_histogram(store, ["a", "b"], n_bins=25)
    assert df.columns == ["run", "bin_lo", "bin_hi", "count", "frac"]
    d_all = _delta(data.tokens)
    lo, hi = d_all.min(), d_all.max()
    for run in ("a", "b"):
        got = df.filter(pl.col("run") == run)
        d = _delta(data.tokens.filter(pl.col("run") == run))
        ref = _ref_counts(d, lo, hi, 25)
        idx = np.round((got["bin_lo"].to_numpy() - lo) / ((hi - lo) / 25)).astype(int)
        assert dict(zip(idx.tolist(), got["count"].to_list())) == ref
        assert got["frac"].sum() == pytest.approx(1.0, rel=1e-12)
        assert got.height <= 25


def test_log_ratio_histogram_with_range_drops_outside(metrics_data):
    store, data = metrics_data
    df = distributions.log_ratio_histogram(store, ["a"], n_bins=10, lo=-0.5, hi=0.5)
    d = _delta(data.tokens.filter(pl.col("run") == "a"))
    assert df["count"].sum() == int(((d >= -0.5) & (d <= 0.5)).sum())
    assert df["frac"].sum() == pytest.approx(((d >= -0.5) & (d <= 0.5)).mean(), rel=1e-12)
    assert df["bin_lo"].min() >= -0.5 and df["bin_hi"].max() <= 0.5 + 1e-12


def test_ratio_histogram_is_log_binned(metrics_data):
    store, data = metrics_data
    df = distributions.ratio_histogram(store, ["a"], n_bins=16)
    d = np.clip(_delta(data.tokens.filter(pl.col("run") == "a")), -20, 20)
    assert df["count"].sum() == len(d)
    widths = np.log10(df["bin_hi"].to_numpy()) - np.log10(df["bin_lo"].to_numpy())
    assert np.allclose(widths, widths[0])
    assert df["bin_lo"].min() == pytest.approx(math.exp(d.min()), rel=1e-9)


def test_step_histogram_per_step_and_stride(metrics_data, monkeypatch):
    store, data = metrics_data
    df = distributions.step_histogram(store, "a", n_bins=12)
    assert df.columns == ["step", "bin_lo", "bin_hi", "count", "frac"]
    counts = df.group_by("step").agg(pl.col("count").sum(), pl.col("frac").sum()).sort("step")
    want = data.tokens.filter(pl.col("run") == "a").group_by("step").len().sort("step")
    assert counts["count"].to_list() == want["len"].to_list()
    assert np.allclose(counts["frac"].to_numpy(), 1.0)
    monkeypatch.setattr(distributions, "MAX_CELLS", 24)  # 3 steps × 12 bins > 24: merge steps in pairs
    merged = distributions.step_histogram(store, "a", n_bins=12)
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
    assert df["count"].to_list() == [3] and df["bin_lo"][0] <= 0.0 <= df["bin_hi"][0]


def _bundle_matches(store, runs, n_bins, steps=None):
    from analysis import metrics
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
