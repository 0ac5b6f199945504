"""Where the mismatch lives: METRICS.md token metrics grouped by a bucketed token property, and per token."""
from __future__ import annotations

import math
from typing import Sequence

import polars as pl

from analysis import schema
from analysis.metrics import (TOKEN_METRICS, cap_clip_params, check_cap_clip, check_runs, clamp_sql, grouped_token_metrics_sql,
                              kl3_sql, ratio_sql, token_filter)
from analysis.store import Store

DIMENSIONS = ("prob", "position", "length", "entropy", "lag")
BUCKET_COLUMNS = ("run", "bucket", "bucket_lo", "bucket_hi", "label", "n_tokens", "kl_k1", "kl_k3",
                  "log_ratio_abs_mean", "log_ratio_abs_max", "ratio_frac_high", "ratio_frac_low", "clip_frac",
                  "prob_abs_diff_mean")
PROB_FLOOR_LOG10 = -12.0  # sampler probabilities below 1e-12 share the lowest bin

# x: the bucketed quantity per token, as SQL over `tokens` (length needs its sequence, hence the window).
_X = {
    "prob": "sampler_logprob / ln(10)",  # log10 of the sampler probability
    "position": "pos",
    "length": "max(pos) OVER (PARTITION BY run, step, sample) + 1",
    "entropy": "sampler_entropy",
    "lag": "trainer_version - sampler_version",
}
_X_PRESENT = {"entropy": "sampler_entropy IS NOT NULL",
              "lag": "trainer_version IS NOT NULL AND sampler_version IS NOT NULL"}


def _columns(metrics: Sequence[str] | None) -> list[str]:
    """The frame's columns: the bucket's own, n_tokens, then the chosen metrics (all: BUCKET_COLUMNS first)."""
    if metrics is None:
        return list(BUCKET_COLUMNS) + [m for m in TOKEN_METRICS if m not in BUCKET_COLUMNS]
    own = [c for c in BUCKET_COLUMNS if c not in TOKEN_METRICS]  # run, bucket, its edges and label
    return own + ["n_tokens"] + [m for m in TOKEN_METRICS if m in metrics and m != "n_tokens"]


def _empty(metrics: Sequence[str] | None) -> pl.DataFrame:
    types = {"run": pl.String, "bucket": pl.Int64, "bucket_lo": pl.Float64, "bucket_hi": pl.Float64,
             "label": pl.String, "n_tokens": pl.Int64, "n_sequences": pl.Int64}
    return pl.DataFrame(schema={c: types.get(c, pl.Float64) for c in _columns(metrics)})


def mismatch_by(store: Store, runs: list[str], dimension: str, n_bins: int = 12, cap: float = 2.0,
                clip: float = 0.2, steps: tuple[int, int] | None = None,
                metrics: Sequence[str] | None = None) -> pl.DataFrame:
    """METRICS.md token metrics per (run, bucket) of one token property.

    dimension:
      - "prob": sampler probability exp(s) in `n_bins` equal bins of log10 p between the lowest decade seen
        (not below 1e-12) and 1;
      - "position": position in the response; "length": response length of the token's sequence
        (max pos + 1): `n_bins` equal integer-width bins between the min and max seen;
      - "entropy": sampler_entropy, `n_bins` equal bins between min and max (empty frame without entropies);
      - "lag": staleness trainer_version − sampler_version, one bucket per value, bucket = the lag
        (empty frame without versions).
    Buckets are the half-open [bucket_lo, bucket_hi) in the property's own units (probability for "prob");
    the top edge of the last bin is inclusive. bucket is the 0-based bin index (the lag for "lag").
    Metrics as in `metrics.token_metrics` (kl_k1/kl_k3 estimate KL(π_sampler ‖ π_trainer)); sequence
    metrics use each sequence's tokens inside the bucket. Empty buckets give no row.
    Returns [run, bucket, bucket_lo, bucket_hi, label, n_tokens, kl_k1, kl_k3, log_ratio_abs_mean,
    log_ratio_abs_max, ratio_frac_high, ratio_frac_low, clip_frac, prob_abs_diff_mean, <other token metrics>];
    `metrics`: only these token metrics (the bucket columns and n_tokens always come): a chart showing one
    metric costs about half the full table's query (one GROUP BY, fewer aggregates).
    """
    if dimension not in DIMENSIONS:
        raise ValueError(f"dimension must be one of {', '.join(DIMENSIONS)}, got {dimension!r}")
    if int(n_bins) < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    n_bins = int(n_bins)
    if metrics is not None and (unknown := [m for m in metrics if m not in TOKEN_METRICS]):
        raise ValueError(f"unknown token metric(s) {', '.join(map(repr, unknown))}; see metrics.TOKEN_METRICS")
    check_cap_clip(cap, clip)
    runs = check_runs(runs)
    where, params = token_filter(store, runs, steps)
    if dimension in _X_PRESENT:
        where += f" AND {_X_PRESENT[dimension]}"
    x = _X[dimension]
    xsrc = f"SELECT run, step, sample, sampler_logprob AS s, trainer_logprob AS t, {x} AS x FROM tokens WHERE {where}"
    lo, hi = store.rows(f"SELECT min(x), max(x) FROM ({xsrc})", params)[0]
    if lo is None:
        return _empty(metrics)
    if dimension == "lag":
        width, lo = 1.0, 0.0
        bucket_sql = "x::BIGINT"
    else:
        lo, width = _grid(dimension, float(lo), float(hi), n_bins)
        bucket_sql = f"{clamp_sql('floor((x - $lo) / $width)', '0', str(n_bins - 1))}::BIGINT"
        params.update(lo=lo, width=width)
    src = f"SELECT run, step, sample, s, t, {bucket_sql} AS bucket FROM ({xsrc})"
    params.update(cap_clip_params(cap, clip))
    sql = grouped_token_metrics_sql(src, ["run", "bucket"], only=metrics)
    df = store.sql(sql, {k: v for k, v in params.items() if f"${k}" in sql})  # C and ε only if a metric uses them
    edge_lo = pl.lit(lo) + pl.col("bucket").cast(pl.Float64) * width
    edge_hi = edge_lo + width
    if dimension == "prob":
        edge_lo, edge_hi = 10.0 ** edge_lo, 10.0 ** edge_hi
    df = df.with_columns(bucket_lo=edge_lo, bucket_hi=edge_hi)
    df = df.with_columns(label=pl.Series([_label(dimension, a, b) for a, b in
                                          zip(df["bucket_lo"].to_list(), df["bucket_hi"].to_list())],
                                         dtype=pl.String))
    return df.select(_columns(metrics))


def _grid(dimension: str, lo: float, hi: float, n_bins: int) -> tuple[float, float]:
    """(lower edge, bin width) of `n_bins` equal bins covering [lo, hi]."""
    if dimension == "prob":
        lo = min(max(math.floor(lo), PROB_FLOOR_LOG10), -1.0)
        return lo, -lo / n_bins
    if dimension in ("position", "length"):
        return lo, float(max(1, math.ceil((hi - lo + 1) / n_bins)))
    return lo, (hi - lo) / n_bins if hi > lo else 1.0


def _label(dimension: str, lo: float, hi: float) -> str:
    if dimension == "lag":
        return f"lag {int(lo)}"
    if dimension in ("position", "length"):
        a, b = int(round(lo)), int(round(hi)) - 1
        return str(a) if a == b else f"{a}–{b}"
    return f"{lo:.3g}–{hi:.3g}"


def top_tokens(store: Store, run: str, n: int = 20, min_count: int = 5, steps: tuple[int, int] | None = None,
               order: str = "log_ratio_abs_mean") -> pl.DataFrame:
    """The vocabulary entries with the largest mismatch in one run (tokens seen at least `min_count` times).

    Grouped by (token_id, token); log_ratio_abs_mean = mean |Δ|, kl_k3 = mean(r − 1 − Δ) (KL(π_sampler ‖
    π_trainer)), log_ratio_abs_max = max |Δ|, Δ = t − s. Sorted by `order` (one of those three), descending.
    Returns [token_id, token, n_tokens, log_ratio_abs_mean, kl_k3, log_ratio_abs_max]; empty without token data.
    """
    if order not in ("log_ratio_abs_mean", "kl_k3", "log_ratio_abs_max", "n_tokens"):
        raise ValueError(f"order must be log_ratio_abs_mean, kl_k3, log_ratio_abs_max or n_tokens, got {order!r}")
    where, params = token_filter(store, [run], steps)
    params.update(min_count=int(min_count), n=int(n))
    return store.sql(f"""
        SELECT token_id, token, count(*) AS n_tokens, avg(abs(d)) AS log_ratio_abs_mean,
               avg({kl3_sql(ratio_sql('d'))}) AS kl_k3, max(abs(d)) AS log_ratio_abs_max
        FROM (SELECT token_id, token, trainer_logprob - sampler_logprob AS d FROM tokens
              WHERE {where} AND (token_id IS NOT NULL OR token IS NOT NULL))
        GROUP BY token_id, token HAVING count(*) >= $min_count
        ORDER BY {order} DESC, n_tokens DESC, token_id, token LIMIT $n""", params)


def has_column_data(store: Store, runs: list[str], column: str) -> bool:
    """Whether any token of `runs` has a non-null value in the optional tokens column `column`."""
    if column not in schema.names("tokens"):
        raise ValueError(f"unknown tokens column {column!r}; expected one of {', '.join(schema.names('tokens'))}")
    where, params = token_filter(store, check_runs(runs), None)
    return bool(store.scalar(f"SELECT EXISTS (SELECT 1 FROM tokens WHERE {where} AND {column} IS NOT NULL)",
                             params))
