"""metrics.token_metrics and extreme_token_curve against brute-force numpy, plus METRICS.md's edge cases."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.metrics import token as metrics

from helpers.data import metrics_make_tokens
from helpers.reference import assert_frame_matches, ratio, ref_grouped

CONTRACT_COLUMNS = ["n_tokens", "n_sequences", "kl_k1", "kl_k2", "kl_k3", "log_ratio_abs_mean",
                    "log_ratio_abs_max", "prob_abs_diff_mean", "prob_abs_diff_max", "prob_pearson", "ratio_mean",
                    "ratio_std", "ratio_min", "ratio_max", "chi2_token", "ratio_frac_high", "ratio_frac_low",
                    "clip_frac", "ess", "ppl_ratio", "chi2_seq", "seq_log_ratio_abs_max", "mult_prob_error",
                    "kl_k3_reverse", "seq_geo_ratio_mean", "seq_geo_ratio_min", "seq_geo_ratio_max"]


def test_columns_are_the_contract(metrics_data):
    store, _ = metrics_data
    checks = ["ratio_mean_se", "missing_mass", "logprob_slope", "logprob_slope_se", "lag_abs_delta_prev",
              "lag_abs_delta_next"]
    residual = ["first_token_kl_share", "lattice_share_q", "boundary_low_share", "elsewhere_low_share"]
    assert metrics.token_metrics(store, ["a"]).columns == ["run", "step"] + CONTRACT_COLUMNS + checks + residual
    assert metrics.token_metrics(store, ["a"], by="run").columns == ["run"] + CONTRACT_COLUMNS + checks + residual
    assert list(metrics.TOKEN_METRICS) == CONTRACT_COLUMNS and list(metrics.CHECK_METRICS) == checks
    assert list(metrics.RESIDUAL_METRICS) == residual


@pytest.mark.parametrize("cap, clip", [(2.0, 0.2), (1.5, 0.05)])
def test_by_step_matches_numpy(metrics_data, cap, clip):
    store, data = metrics_data
    df = metrics.token_metrics(store, ["a", "b"], by="step", cap=cap, clip=clip)
    assert df["run"].to_list() == sorted(df["run"].to_list())
    assert_frame_matches(df, ref_grouped(data.tokens, ["run", "step"], cap, clip), ["run", "step"])


def test_by_run_and_step_range_match_numpy(metrics_data):
    store, data = metrics_data
    df = metrics.token_metrics(store, ["b", "a"], by="run", steps=(1, 2))
    sub = data.tokens.filter(pl.col("step").is_between(1, 2))
    assert_frame_matches(df, ref_grouped(sub, ["run"]), ["run"])
    one = metrics.token_metrics(store, ["b"], by="step", steps=(2, 2))
    assert one["step"].to_list() == [2] and one["run"].to_list() == ["b"]


def test_jsonl_ingest_path_gives_the_same_numbers(metrics_store_from):
    tokens = metrics_make_tokens(seed=3, runs=("j",), steps=(0, 4), n_seq=3)
    store = metrics_store_from(tokens, fmt="jsonl")
    df = metrics.token_metrics(store, ["j"])
    assert_frame_matches(df, ref_grouped(tokens, ["run", "step"]), ["run", "step"])


def _tokens(s, t, run="e", step=0, sample=None):
    n = len(s)
    return pl.DataFrame({"run": [run] * n, "step": [step] * n,
                         "sample": sample if sample is not None else [0] * n,
                         "pos": list(range(n)) if sample is None else _positions(sample),
                         "sampler_logprob": [float(x) for x in s], "trainer_logprob": [float(x) for x in t]})


def _positions(sample):
    seen: dict = {}
    out = []
    for x in sample:
        out.append(seen.get(x, 0))
        seen[x] = out[-1] + 1
    return out


def test_identical_logprobs_give_exact_zeros_and_ones(metrics_store_from):
    rng = np.random.default_rng(0)
    s = -rng.exponential(2.0, 300)
    store = metrics_store_from(_tokens(s, s, sample=list(rng.integers(0, 7, 300))))
    for by in ("step", "run"):
        row = metrics.token_metrics(store, ["e"], by=by).row(0, named=True)
        for col in ("kl_k1", "kl_k2", "kl_k3", "log_ratio_abs_mean", "log_ratio_abs_max", "prob_abs_diff_mean",
                    "prob_abs_diff_max", "ratio_std", "chi2_token", "ratio_frac_high", "ratio_frac_low",
                    "clip_frac", "chi2_seq", "seq_log_ratio_abs_max", "kl_k3_reverse"):
            assert row[col] == 0.0, (col, row[col])
        for col in ("ratio_mean", "ratio_min", "ratio_max", "ess", "ppl_ratio", "mult_prob_error",
                    "seq_geo_ratio_mean", "seq_geo_ratio_min", "seq_geo_ratio_max"):
            assert row[col] == 1.0, (col, row[col])
        assert row["prob_pearson"] == pytest.approx(1.0, abs=1e-12)


def test_one_token(metrics_store_from):
    store = metrics_store_from(_tokens([math.log(0.5)], [math.log(0.25)]))
    row = metrics.token_metrics(store, ["e"]).row(0, named=True)
    assert row["n_tokens"] == 1 and row["n_sequences"] == 1
    assert row["prob_pearson"] is None
    assert row["ratio_std"] == 0.0 and row["ess"] == 1.0
    assert row["kl_k1"] == pytest.approx(math.log(2), rel=1e-15)
    assert row["ratio_mean"] == pytest.approx(0.5, rel=1e-15)
    assert row["ratio_frac_low"] == 0.0  # 0.5 is not < 1/C


def test_log_ratio_beyond_clamp(metrics_store_from):
    # Δ = +30 and −35: r is clamped to e^±20, |Δ| metrics are not; a sequence sum beyond ±20 is clamped too
    s = [-40.0, -1.0, -0.5, -2.0]
    t = [-10.0, -36.0, -0.5, -2.0]
    tokens = _tokens(s, t, sample=[0, 1, 2, 2])
    store = metrics_store_from(tokens)
    row = metrics.token_metrics(store, ["e"]).row(0, named=True)
    assert row["ratio_max"] == math.exp(20.0) and row["ratio_min"] == math.exp(-20.0)
    assert row["log_ratio_abs_max"] == 35.0
    assert all(math.isfinite(row[c]) for c in metrics.TOKEN_METRICS if row[c] is not None)
    assert_frame_matches(metrics.token_metrics(store, ["e"]), ref_grouped(tokens, ["run", "step"]), ["run", "step"])
    assert row["chi2_seq"] == pytest.approx((math.exp(40) - 1 + math.exp(-40) - 1 + 0.0) / 3, rel=1e-12)


def test_empty_selection_gives_no_rows(metrics_data):
    store, _ = metrics_data
    for by in ("step", "run"):
        df = metrics.token_metrics(store, ["a"], by=by, steps=(100, 200))
        tail = CONTRACT_COLUMNS + list(metrics.CHECK_METRICS) + list(metrics.RESIDUAL_METRICS)
        assert df.height == 0 and df.columns[-len(tail):] == tail
        assert metrics.token_metrics(store, ["no-such-run"], by=by).height == 0
        assert metrics.token_metrics(store, [], by=by).height == 0
    assert metrics.extreme_token_curve(store, ["a"], steps=(100, 200)).height == 0


def test_constant_probabilities_give_null_pearson(metrics_store_from):
    s = [math.log(0.3)] * 5
    t = [math.log(0.2), math.log(0.4), math.log(0.3), math.log(0.1), math.log(0.5)]
    store = metrics_store_from(_tokens(s, t, sample=[0, 0, 1, 1, 1]))
    row = metrics.token_metrics(store, ["e"]).row(0, named=True)
    assert row["prob_pearson"] is None
    assert row["n_sequences"] == 2


def test_extreme_token_curve_matches_numpy(metrics_data):
    store, data = metrics_data
    taus = [1.01, 1.2, 2.0, 5.0, 1e6]
    df = metrics.extreme_token_curve(store, ["a", "b"], taus=taus)
    assert df.columns == ["run", "tau", "frac"] and df.height == 2 * len(taus)
    for row in df.iter_rows(named=True):
        g = data.tokens.filter(pl.col("run") == row["run"])
        r = ratio(g["trainer_logprob"].to_numpy() - g["sampler_logprob"].to_numpy())
        assert row["frac"] == np.mean(np.maximum(r, 1.0 / r) > row["tau"])
    default = metrics.extreme_token_curve(store, ["a"])
    assert default.height == len(metrics.default_taus()) and default["frac"].is_sorted(descending=True)


def test_invalid_parameters_are_refused(metrics_data):
    store, _ = metrics_data
    with pytest.raises(ValueError, match="by must be"):
        metrics.token_metrics(store, ["a"], by="layer")
    with pytest.raises(ValueError, match="cap C must be > 1"):
        metrics.token_metrics(store, ["a"], cap=1.0)


def test_docstring_examples(metrics_store_from):
    # extreme_token_curve: r = 1, 1.5, 4 gives F(1.2) = 2/3, F(2) = 1/3, F(5) = 0
    s = [-2.0, -2.0, -2.0]
    store = metrics_store_from(_tokens(s, [-2.0, -2.0 + math.log(1.5), -2.0 + math.log(4.0)]))
    df = metrics.extreme_token_curve(store, ["e"], taus=[1.2, 2.0, 5.0])
    assert df["frac"].to_list() == [pytest.approx(2 / 3), pytest.approx(1 / 3), 0.0]


def test_ess_is_exactly_one_when_every_weight_is_capped(metrics_store_from):
    # all r > C: every w = C, so ess = 1 exactly although r varies
    store = metrics_store_from(_tokens([-5.0, -6.0, -7.0], [-1.0, -0.5, -2.0]))
    row = metrics.token_metrics(store, ["e"], cap=2.0).row(0, named=True)
    assert row["ess"] == 1.0 and row["ratio_frac_high"] == 1.0


def test_extreme_token_curve_at_tau_boundaries(metrics_data):
    # taus equal to some tokens' own max(r, 1/r) (strict > must exclude them), repeated and unsorted
    store, data = metrics_data
    g = data.tokens.filter(pl.col("run") == "a")
    # max(r, 1/r) > τ is compared in log space, |clamp Δ| > ln τ (as the summaries' Δ bins are): the same
    # tokens up to rounding at the boundary, which this test pins to the log-space comparison
    d = g["trainer_logprob"].to_numpy() - g["sampler_logprob"].to_numpy()
    m = np.abs(np.clip(d, -20.0, 20.0))
    picks = [math.exp(float(x)) for x in np.sort(m)[[0, 3, len(m) // 2, -2, -1]]]
    taus = picks + [picks[2], 1.0, 0.5, 1e300]
    df = metrics.extreme_token_curve(store, ["a"], taus=taus)
    assert df["tau"].to_list() == sorted(taus)
    for tau, frac in zip(df["tau"].to_list(), df["frac"].to_list()):
        assert frac == np.mean(m > (math.log(tau) if tau > 0 else -math.inf))


@pytest.mark.parametrize("runs, steps", [(["a", "b"], None), (["b"], (1, 2)), (["a"], (9, 9)), ([], None)])
def test_run_and_step_tables_from_one_pass_equal_the_separate_queries(metrics_data, runs, steps):
    store, data = metrics_data
    both = metrics.token_metrics_by_run_and_step(store, runs, cap=1.7, clip=0.1, steps=steps)
    for by in ("run", "step"):
        one = metrics.token_metrics(store, runs, by=by, cap=1.7, clip=1.0 / 10, steps=steps)
        assert both[by].schema == one.schema
        assert both[by].select("run", *(["step"] if by == "step" else [])).equals(
            one.select("run", *(["step"] if by == "step" else [])))
        for col in one.columns:
            for x, y in zip(both[by][col].to_list(), one[col].to_list()):
                assert x == y if not isinstance(x, float) else x == pytest.approx(y, rel=1e-12, abs=1e-15), col
    if runs and steps is None:  # and against the numpy reference, independently of token_metrics
        assert_frame_matches(both["step"], ref_grouped(data.tokens.filter(pl.col("run").is_in(runs)),
                                                       ["run", "step"], cap=1.7, clip=0.1), ["run", "step"])


def test_kl_k3_is_never_negative_for_tiny_log_ratios(metrics_store_from):
    # t one ulp above s: Δ ≈ 2e-19 ≠ 0 but exp(Δ) rounds to 1.0, so the naive r − 1 − Δ is −Δ < 0 although
    # e^Δ − 1 − Δ ≥ 0; the series form of the k3 term gives its true value Δ²/2 (+ Δ³/6 ...), never below 0
    s = [-1e-3, -2e-3, -5e-4]
    t = [float(np.nextafter(x, 0.0)) for x in s]
    d = np.array(t) - np.array(s)
    assert (d > 0).all() and (np.exp(d) - 1.0 - d < 0).all()  # the rounding this test is about
    store = metrics_store_from(_tokens(s, t))
    row = metrics.token_metrics(store, ["e"], by="run").row(0, named=True)
    assert row["kl_k3"] == pytest.approx(float(np.mean(d * d / 2)), rel=1e-12) and row["kl_k3"] > 0
    assert row["kl_k1"] < 0
