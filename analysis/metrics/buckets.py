"""Where the mismatch lives: METRICS.md token metrics grouped by a bucketed token property, and per token."""
from __future__ import annotations

import math
from typing import Sequence

import polars as pl

from analysis import schema
from analysis.metrics import sampled
from analysis.metrics.token import SEQUENCE_METRICS, TOKEN_METRICS, cap_clip_params, grouped_token_metrics_sql
from analysis.store import Store
from analysis.summaries.finalise import bucket_table_sql, sequences_sql, summarised, threshold_params
from analysis.summaries.schema import BAND_EDGES, ENTROPY_EDGES, PROB_LO, PROB_WIDTH
from analysis.summaries.sql import (
    bucket_params,
    bucket_sql,
    check_cap_clip,
    check_runs,
    kl3_sql,
    ratio_sql,
    run_filter,
    token_filter,
)

DIMENSIONS = ("prob", "position", "length", "entropy", "lag", "tag", "segment")
# dimensions that are a property of the whole sequence: grouped from the per-sequence summaries
SEQUENCE_DIMENSIONS = ("length", "tag")
BUCKET_COLUMNS = ("run", "bucket", "bucket_lo", "bucket_hi", "label", "n_tokens", "kl_k1", "kl_k3",
                  "log_ratio_abs_mean", "log_ratio_abs_max", "ratio_frac_high", "ratio_frac_low", "clip_frac",
                  "prob_abs_diff_mean")

# x: the bucketed quantity per token, as SQL over `tokens` (length needs its sequence, hence the window);
# the bucket of x is summaries.compute.bucket_sql, on the fixed edges of summaries/schema.py
_LENGTH = "max(pos) OVER (PARTITION BY run, step, sample) + 1"
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
                metrics: Sequence[str] | None = None, tags: Sequence[str] | None = None) -> pl.DataFrame:
    """METRICS.md token metrics per (run, bucket) of one token property, on fixed global bucket edges
    (summaries/schema.py; `n_bins` is accepted for compatibility and ignored).

    dimension:
      - "prob": sampler probability exp(s), half-decade bins of log10 p from 1e-12 (lower ones in the first) to 1;
      - "position": position in the response, "length": response length of the token's sequence (max pos + 1):
        0, 1, 2–3, 4–7, ... (powers of two);
      - "entropy": sampler_entropy on fixed edges from 0 to 8 nats and above (empty frame without entropies);
      - "lag": staleness trainer_version − sampler_version, bucket = the lag (empty frame without versions);
      - "tag": the sequence's tag (table `sequences`), bucket = its rank among the tags shown, label = the tag;
      - "segment": the token's turn in a multi-turn rollout (tokens.segment), bucket = the turn index.
    Buckets are the half-open [bucket_lo, bucket_hi) in the property's own units (probability for "prob");
    bucket is the bin index (the lag for "lag"). Empty buckets give no row.
    tags: only the tokens of sequences with one of these tags.

    Read from the summaries (every token, cost independent of the number of tokens) when C and ε are allowed
    values (schema.CAPS / CLIPS), the dimension is a summarised one (all but "segment"), no tag filter splits a
    token-property bucket (a filter is exact for "length" and "tag" only), and no sequence metric is asked for a
    dimension other than "length" / "tag" (a bucket of a token property splits sequences); otherwise from the
    token rows (`mismatch_by_tokens`), where sequence metrics use each sequence's tokens inside the bucket.
    Returns [run, bucket, bucket_lo, bucket_hi, label, n_tokens, kl_k1, kl_k3, log_ratio_abs_mean,
    log_ratio_abs_max, ratio_frac_high, ratio_frac_low, clip_frac, prob_abs_diff_mean, <other token metrics>];
    `metrics`: only these token metrics (the bucket columns and n_tokens always come).
    """
    metrics = _check(dimension, cap, clip, metrics)
    runs = check_runs(runs)
    tags = None if tags is None else [str(t) for t in tags]
    seq_asked = set(TOKEN_METRICS if metrics is None else metrics) & {"n_sequences", *SEQUENCE_METRICS}
    per_sequence = dimension in SEQUENCE_DIMENSIONS
    if (not summarised(cap, clip) or dimension == "segment" or (seq_asked and not per_sequence)
            or (tags is not None and not per_sequence)):
        return mismatch_by_tokens(store, runs, dimension, cap, clip, steps, metrics, tags=tags)
    where, params = run_filter(runs, steps)
    params |= threshold_params(cap, clip, BAND_EDGES)
    if not per_sequence:
        params["dim"] = dimension
    buckets = None
    if dimension == "tag" or tags is not None:
        w_, p_ = run_filter(runs, steps, prefix="tq_")
        chosen = "" if tags is None else " AND list_contains($tag_list, tag)"
        params |= p_ | ({"tag_list": tags} if tags is not None else {})
        bucket = "tag" if dimension == "tag" else "b_.bucket"
        buckets = f"SELECT run, step, sample, {bucket} AS bucket FROM sequences WHERE {w_} AND tag IS NOT NULL{chosen}"
        if dimension == "length":  # the length buckets of the chosen tags' sequences
            lengths = f"SELECT run, step, sample, {bucket_sql('length')} AS bucket FROM ({sequences_sql(where)}) l_"
            buckets = buckets.replace("FROM sequences", f"FROM sequences JOIN ({lengths}) b_ USING (run, step, sample)")
    sql = bucket_table_sql(dimension, where, bucket_sql("length"), sequence_buckets=buckets)
    df = store.sql(sql, {k: v for k, v in params.items() if f"${k}" in sql})
    return _with_edges(df, dimension, metrics)


def mismatch_by_tokens(store: Store, runs: list[str], dimension: str, cap: float = 2.0, clip: float = 0.2,
                       steps: tuple[int, int] | None = None, metrics: Sequence[str] | None = None,
                       tags: Sequence[str] | None = None) -> pl.DataFrame:
    """`mismatch_by` from the token rows (same buckets, same columns): the drill-down path, and the reference
    the summaries are tested against. Exact for every token only where the token rows are complete."""
    metrics = _check(dimension, cap, clip, metrics)
    runs = check_runs(runs)
    where, params = token_filter(store, runs, steps)
    if dimension in _X_PRESENT:
        where += f" AND {_X_PRESENT[dimension]}"
    length = f", {_LENGTH} AS length" if dimension == "length" else ""
    segment = "segment" if store.has_columns("tokens", ["segment"]) else "NULL::INTEGER AS segment"
    xsrc = (f"SELECT run, step, sample, pos, sampler_logprob AS s, trainer_logprob AS t, sampler_entropy, "
            f"trainer_version, sampler_version, {segment}{length} FROM tokens WHERE {where}")
    if dimension == "tag" or tags is not None:  # the sequence's tag, from `sequences`
        chosen = "" if tags is None else " AND list_contains($tag_list, q_.tag)"
        params |= {} if tags is None else {"tag_list": list(tags)}
        xsrc = (f"SELECT x_.*, q_.tag FROM ({xsrc}) x_ JOIN sequences q_ USING (run, step, sample) "
                f"WHERE q_.tag IS NOT NULL{chosen}")
    x = {"tag": "tag", "segment": "segment"}.get(dimension)
    bucket = x if x is not None else bucket_sql(dimension)
    src = f"SELECT run, step, sample, s, t, {bucket} AS bucket FROM ({xsrc}) WHERE {bucket} IS NOT NULL"
    params.update(cap_clip_params(cap, clip))
    params.update(bucket_params())
    sql = grouped_token_metrics_sql(src, ["run", "bucket"], only=metrics)
    df = store.sql(sql, {k: v for k, v in params.items() if f"${k}" in sql})  # C and ε only if a metric uses them
    return _with_edges(df, dimension, metrics)


def full_distribution_by(store: Store, runs: list[str], dimension: str,
                         steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """METRICS.md v3 "Full distribution" columns per (run, bucket) of the sequences' response length ("length":
    1 + max pos, on the power-of-two buckets of `mismatch_by`) or tag ("tag": sequences.tag; bucket = its rank,
    label = the tag), with kl_k3 and log_ratio_abs_mean of the same sequences' sampled tokens beside them.
    From the per-sequence summaries (summary_seq's TOPK_SUMS and TOKEN_SUMS): every token, whatever the token
    sample. Returns [run, bucket, label, n_sequences, n_tokens, kl_k3, log_ratio_abs_mean, n_topk, topk_*];
    the topk_* columns are null in buckets without top-k lists; empty where the database has no such sums or
    (tag) no tags."""
    from analysis.summaries.finalise import TOPK_COLUMNS, topk_by_sql
    if dimension not in SEQUENCE_DIMENSIONS:
        raise ValueError(f"dimension must be one of {', '.join(SEQUENCE_DIMENSIONS)}, got {dimension!r}")
    runs = check_runs(runs)
    cols = ["run", "bucket", "label", "n_sequences", "n_tokens", "kl_k3", "log_ratio_abs_mean", "n_topk",
            *TOPK_COLUMNS]
    types = {"run": pl.String, "bucket": pl.Int64, "label": pl.String, "n_sequences": pl.Int64,
             "n_tokens": pl.Int64, "n_topk": pl.Int64}
    empty = pl.DataFrame(schema={c: types.get(c, pl.Float64) for c in cols})
    if not store.has_seq_topk_sums or (dimension == "tag" and not store.has_columns("sequences", ["tag"])):
        return empty
    where, params = run_filter(runs, steps)
    tag_where, tag_params = run_filter(runs, steps, prefix="tq_")
    df = store.sql(topk_by_sql(dimension, where, tag_where if dimension == "tag" else None),
                   params | (tag_params if dimension == "tag" else {}))
    if df.is_empty():
        return empty
    if dimension == "tag":
        rank = {t: i for i, t in enumerate(sorted(set(df["bucket"].to_list())))}
        df = df.with_columns(label=pl.col("bucket").cast(pl.String),
                             bucket=pl.col("bucket").replace_strict(rank, return_dtype=pl.Int64))
    else:
        df = df.with_columns(bucket=pl.col("bucket").cast(pl.Int64))
        df = df.with_columns(label=pl.Series([_label("length", *bucket_edges("length", int(b)))
                                              for b in df["bucket"].to_list()], dtype=pl.String))
    return df.sort("run", "bucket").select(cols)


def _check(dimension: str, cap: float, clip: float, metrics: Sequence[str] | None) -> list[str] | None:
    if dimension not in DIMENSIONS:
        raise ValueError(f"dimension must be one of {', '.join(DIMENSIONS)}, got {dimension!r}")
    if metrics is not None and (unknown := [m for m in metrics if m not in TOKEN_METRICS]):
        raise ValueError(f"unknown token metric(s) {', '.join(map(repr, unknown))}; see metrics.TOKEN_METRICS")
    check_cap_clip(cap, clip)
    return None if metrics is None else list(metrics)


def bucket_edges(dimension: str, bucket: int) -> tuple[float, float]:
    """[lo, hi) of a bucket in the property's units (the fixed edges of summaries/schema.py; a tag's rank,
    a segment's index)."""
    if dimension == "prob":
        return 10.0 ** (PROB_LO + bucket * PROB_WIDTH), 10.0 ** (PROB_LO + (bucket + 1) * PROB_WIDTH)
    if dimension in ("position", "length"):
        return (0.0, 1.0) if bucket == 0 else (float(2 ** (bucket - 1)), float(2 ** bucket))
    if dimension == "entropy":
        hi = ENTROPY_EDGES[bucket + 1] if bucket + 1 < len(ENTROPY_EDGES) else math.inf
        return ENTROPY_EDGES[bucket], hi
    return float(bucket), float(bucket + 1)


def _with_edges(df: pl.DataFrame, dimension: str, metrics: Sequence[str] | None) -> pl.DataFrame:
    if df.is_empty():
        return _empty(metrics)
    if dimension == "tag":  # the tags in order, numbered; the label is the tag itself
        names = sorted(set(df["bucket"].to_list()))
        rank = {t: i for i, t in enumerate(names)}
        df = df.with_columns(label=pl.col("bucket").cast(pl.String),
                             bucket=pl.col("bucket").replace_strict(rank, return_dtype=pl.Int64))
        df = df.with_columns(bucket_lo=pl.col("bucket").cast(pl.Float64), bucket_hi=pl.col("bucket") + 1.0)
        return df.sort("run", "bucket").select(_columns(metrics))
    edges = [bucket_edges(dimension, int(b)) for b in df["bucket"].to_list()]
    df = df.with_columns(bucket=pl.col("bucket").cast(pl.Int64),
                         bucket_lo=pl.Series([e[0] for e in edges], dtype=pl.Float64),
                         bucket_hi=pl.Series([e[1] for e in edges], dtype=pl.Float64),
                         label=pl.Series([_label(dimension, *e) for e in edges], dtype=pl.String))
    return df.select(_columns(metrics))


def _label(dimension: str, lo: float, hi: float) -> str:
    if dimension == "lag":
        return f"lag {int(lo)}"
    if dimension == "segment":
        return f"turn {int(lo)}"
    if dimension in ("position", "length"):
        a, b = int(lo), int(hi) - 1
        return str(a) if a == b else f"{a}–{b}"
    if math.isinf(hi):
        return f"≥ {lo:.3g}"
    return f"{lo:.3g}–{hi:.3g}"


def top_tokens(store: Store, run: str, n: int = 20, min_count: int = 5, steps: tuple[int, int] | None = None,
               order: str = "log_ratio_abs_mean", thin: bool = False) -> pl.DataFrame:
    """The vocabulary entries with the largest mismatch in one run (tokens seen at least `min_count` times).

    Grouped by (token_id, token); log_ratio_abs_mean = mean |Δ|, kl_k3 = mean(r − 1 − Δ) (KL(π_sampler ‖
    π_trainer)), log_ratio_abs_max = max |Δ|, Δ = t − s. Sorted by `order` (one of those three), descending.
    thin=True: on a selection of more than sampled.THIN_TOKENS tokens, only the steps `sampled.thin_steps`
    picks (every k-th). Returns [token_id, token, n_tokens, log_ratio_abs_mean, kl_k3, log_ratio_abs_max];
    empty without token data.
    """
    if order not in ("log_ratio_abs_mean", "kl_k3", "log_ratio_abs_max", "n_tokens"):
        raise ValueError(f"order must be log_ratio_abs_mean, kl_k3, log_ratio_abs_max or n_tokens, got {order!r}")
    only = sampled.thin_steps(store, [run], [steps]).steps if thin else None
    where, params = token_filter(store, [run], steps, only_steps=only)
    params.update(min_count=int(min_count), n=int(n))
    return store.sql(f"""
        SELECT token_id, token, count(*) AS n_tokens, avg(abs(d)) AS log_ratio_abs_mean,
               avg({kl3_sql(ratio_sql('d'))}) AS kl_k3, max(abs(d)) AS log_ratio_abs_max
        FROM (SELECT token_id, token, trainer_logprob - sampler_logprob AS d FROM tokens
              WHERE {where} AND (token_id IS NOT NULL OR token IS NOT NULL))
        GROUP BY token_id, token HAVING count(*) >= $min_count
        ORDER BY {order} DESC, n_tokens DESC, token_id, token LIMIT $n""", params)


# Optional token columns whose presence a bucket dimension of the summaries records (a token with entropy has an
# entropy bucket, one with both versions a lag bucket): asked of summary_bucket, a few rows per step, not the tokens.
_SUMMARISED_COLUMNS = {"sampler_entropy": "entropy", "sampler_version": "lag", "trainer_version": "lag"}


def has_column_data(store: Store, runs: list[str], column: str) -> bool:
    """Whether any token of `runs` has a non-null value in the optional tokens column `column` (for the version
    columns: both versions, which is what the lag dimension needs)."""
    if column not in schema.names("tokens"):
        raise ValueError(f"unknown tokens column {column!r}; expected one of {', '.join(schema.names('tokens'))}")
    runs = check_runs(runs)
    if column in _SUMMARISED_COLUMNS:
        where, params = run_filter(runs)
        return bool(store.scalar(f"SELECT EXISTS (SELECT 1 FROM summary_bucket WHERE {where} AND dim = $dim)",
                                 params | {"dim": _SUMMARISED_COLUMNS[column]}))
    where, params = token_filter(store, runs, None)
    return bool(store.scalar(f"SELECT EXISTS (SELECT 1 FROM tokens WHERE {where} AND {column} IS NOT NULL)",
                             params))


def run_tags(store: Store, runs: list[str]) -> list[str]:
    """The tags the sequences of `runs` carry (table `sequences`), sorted; empty without any."""
    runs = check_runs(runs)
    if not store.has_columns("sequences", ["tag"]):
        return []
    where, params = run_filter(runs)
    return [r[0] for r in store.rows(f"SELECT DISTINCT tag FROM sequences WHERE {where} AND tag IS NOT NULL "
                                     "ORDER BY tag", params)]


def has_segments(store: Store, runs: list[str]) -> bool:
    """Whether any token of `runs` has a segment (turn) id, from the summaries' residual counts (n_seg_tokens, a
    row per step): every token with a segment was summarised with them (the column came with both)."""
    runs = check_runs(runs)
    if not store.has_residual_sums:
        return False
    where, params = run_filter(runs)
    return bool(store.scalar(f"SELECT EXISTS (SELECT 1 FROM summary_step WHERE {where} AND n_seg_tokens > 0)",
                             params))
