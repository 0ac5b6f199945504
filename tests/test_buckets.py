"""buckets.mismatch_by / top_tokens / has_column_data against numpy bins and the numpy metric reference."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.metrics import buckets
from analysis.metrics import token as metrics

from helpers.data import metrics_make_tokens
from helpers.reference import assert_close, assert_frame_matches, ratio, ref_grouped

CONTRACT = ["run", "bucket", "bucket_lo", "bucket_hi", "label", "n_tokens", "kl_k1", "kl_k3", "log_ratio_abs_mean",
            "log_ratio_abs_max", "ratio_frac_high", "ratio_frac_low", "clip_frac", "prob_abs_diff_mean"]


def _ref_bucket_index(tokens: pl.DataFrame, dimension: str, n_bins: int = 0) -> np.ndarray:
    """Bin index per token on the fixed global edges (summaries/schema.py), from their documented definition
    (independent of the SQL): half decades of p from 1e-12, powers of two of position and length, the
    entropy edges, the lag itself. `n_bins` is ignored (the edges are fixed)."""
    if dimension == "lag":
        return (tokens["trainer_version"] - tokens["sampler_version"]).to_numpy()
    if dimension == "prob":
        x = tokens["sampler_logprob"].to_numpy() / math.log(10)
        return np.clip(np.floor((x + 12.0) / 0.5), 0, 23).astype(np.int64)
    if dimension in ("position", "length"):
        if dimension == "position":
            x = tokens["pos"].to_list()
        else:
            x = tokens.select(pl.col("pos").max().over("run", "step", "sample") + 1).to_series().to_list()
        return np.array([int(v).bit_length() for v in x], dtype=np.int64)  # 0 | 1 | 2–3 | 4–7 ...
    x = tokens["sampler_entropy"].to_numpy()
    edges = [1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 2.0, 3.0, 5.0, 8.0]
    return np.searchsorted(edges, x, side="right").astype(np.int64)


@pytest.mark.parametrize("dimension", ["prob", "position", "length", "entropy", "lag"])
@pytest.mark.parametrize("cap, clip", [(1.8, 0.1), (2.0, 0.2)])  # token rows (C off the allowed set); summaries
def test_mismatch_by_matches_numpy(metrics_data, dimension, cap, clip):
    store, data = metrics_data
    # summaries hold no sequence metric for a token property's bucket (it splits sequences): the others
    chosen = None if dimension == "length" or cap == 1.8 else [m for m in metrics.TOKEN_METRICS
                                                                  if m not in metrics.SEQUENCE_METRICS + ("n_sequences",)]
    df = buckets.mismatch_by(store, ["a", "b"], dimension, cap=cap, clip=clip, metrics=chosen)
    assert df.columns[:len(CONTRACT)] == CONTRACT if chosen is None else df.columns[:6] == CONTRACT[:6]
    tokens = data.tokens.with_columns(bucket=pl.Series(_ref_bucket_index(data.tokens, dimension)))
    ref = ref_grouped(tokens, ["run", "bucket"], cap=cap, clip=clip)
    assert_frame_matches(df, ref, ["run", "bucket"], columns=[c for c in df.columns if c in metrics.TOKEN_METRICS
                                                              and c in next(iter(ref.values()))])
    assert (df["bucket_lo"] < df["bucket_hi"]).all()
    assert df["label"].null_count() == 0
    assert df.group_by("run").agg(pl.col("n_tokens").sum()).sort("run")["n_tokens"].to_list() == \
        data.tokens.group_by("run").len().sort("run")["len"].to_list()


@pytest.mark.parametrize("dimension, chosen", [("prob", ["kl_k3"]), ("length", CONTRACT[6:]),
                                               ("lag", ["clip_frac", "ess", "kl_k1"]), ("position", ["chi2_seq"])])
def test_mismatch_by_chosen_metrics_match_numpy(metrics_data, dimension, chosen):
    # metrics=[...]: the bucket columns, n_tokens and just those metrics, same values as the numpy reference
    store, data = metrics_data
    df = buckets.mismatch_by(store, ["a", "b"], dimension, cap=1.8, clip=0.1, metrics=chosen)
    assert df.columns == CONTRACT[:6] + [m for m in metrics.TOKEN_METRICS if m in chosen]
    tokens = data.tokens.with_columns(bucket=pl.Series(_ref_bucket_index(data.tokens, dimension)))
    ref = ref_grouped(tokens, ["run", "bucket"], cap=1.8, clip=0.1)
    assert_frame_matches(df, ref, ["run", "bucket"], columns=["n_tokens", *chosen])
    empty = buckets.mismatch_by(store, ["a"], dimension, steps=(10, 20), metrics=chosen)
    assert empty.height == 0 and empty.columns == df.columns
    with pytest.raises(ValueError, match="unknown token metric"):
        buckets.mismatch_by(store, ["a"], dimension, metrics=["kl"])


def test_bucket_edges_contain_their_tokens(metrics_data):
    store, data = metrics_data
    df = buckets.mismatch_by(store, ["a"], "prob", n_bins=12)
    p = np.exp(data.tokens.filter(pl.col("run") == "a")["sampler_logprob"].to_numpy())
    for row in df.iter_rows(named=True):
        inside = (p >= row["bucket_lo"] * (1 - 1e-12)) & (p <= row["bucket_hi"] * (1 + 1e-12))
        assert inside.sum() >= row["n_tokens"]
    assert df["bucket_hi"].max() == pytest.approx(1.0)
    lag = buckets.mismatch_by(store, ["a"], "lag")
    assert set(lag["bucket"]) <= {0, 1, 2} and lag["label"][0].startswith("lag ")


def test_missing_optional_columns_give_empty_frames(metrics_store_from):
    store = metrics_store_from(metrics_make_tokens(seed=5, runs=("p",), steps=(0,), n_seq=2, optional=False))
    for dim in ("entropy", "lag"):
        df = buckets.mismatch_by(store, ["p"], dim)
        assert df.height == 0 and df.columns[:len(CONTRACT)] == CONTRACT
    assert not buckets.has_column_data(store, ["p"], "sampler_entropy")
    assert buckets.top_tokens(store, "p").height == 0
    assert buckets.mismatch_by(store, ["p"], "position").height > 0


def test_has_column_data(metrics_data):
    store, _ = metrics_data
    assert buckets.has_column_data(store, ["a"], "sampler_entropy")
    assert buckets.has_column_data(store, ["a", "b"], "sampler_version")
    assert not buckets.has_column_data(store, ["a"], "trainer_entropy")
    assert not buckets.has_column_data(store, ["zzz"], "sampler_entropy")
    with pytest.raises(ValueError, match="unknown tokens column"):
        buckets.has_column_data(store, ["a"], "sampler_logprob; DROP TABLE tokens")


def test_top_tokens_matches_numpy(metrics_data):
    store, data = metrics_data
    df = buckets.top_tokens(store, "b", n=5, min_count=3, steps=(0, 1))
    assert df.columns == ["token_id", "token", "n_tokens", "log_ratio_abs_mean", "kl_k3", "log_ratio_abs_max"]
    sub = data.tokens.filter((pl.col("run") == "b") & (pl.col("step") <= 1))
    ref = {}
    for (tid,), g in sub.group_by(["token_id"]):
        d = g["trainer_logprob"].to_numpy() - g["sampler_logprob"].to_numpy()
        if len(d) >= 3:
            ref[tid] = (len(d), np.mean(np.abs(d)), np.mean(ratio(d) - 1 - d), np.max(np.abs(d)))
    want = sorted(ref, key=lambda k: -ref[k][1])[:5]
    assert df["token_id"].to_list() == want
    for row in df.iter_rows(named=True):
        n, m, k3, mx = ref[row["token_id"]]
        assert row["n_tokens"] == n and row["token"] == f"tok{row['token_id']}"
        assert_close(row["log_ratio_abs_mean"], m)
        assert_close(row["kl_k3"], k3)
        assert_close(row["log_ratio_abs_max"], mx)


def test_empty_selection_and_bad_dimension(metrics_data):
    store, _ = metrics_data
    for dim in buckets.DIMENSIONS:
        assert buckets.mismatch_by(store, ["a"], dim, steps=(10, 20)).height == 0
    with pytest.raises(ValueError, match="dimension must be one of"):
        buckets.mismatch_by(store, ["a"], "colour")
