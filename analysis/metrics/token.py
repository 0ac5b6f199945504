"""Token-level sampler/trainer mismatch metrics of METRICS.md, aggregated in DuckDB.

Notation: per token `s` = sampler log-prob, `t` = trainer log-prob, Δ = t − s, r = exp(clamp(Δ, −20, 20)).
Tokens are sampled from the sampler, so token means estimate expectations under π_sampler and
kl_k1 / kl_k3 estimate KL(π_sampler ‖ π_trainer).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import polars as pl

from analysis.store import Store
from analysis.summaries import finalise as F
from analysis.summaries import schema as S
from analysis.summaries.schema import TAUS
from analysis.summaries.sql import (
    check_cap_clip,
    check_runs,
    clamp_log_ratio_sql,
    clamp_sql,
    count_below_sql,
    expm1_sql,
    token_filter,
    token_terms_sql,
)

# METRICS.md v2 token columns, written once in analysis/summaries/finalise.py
TOKEN_METRICS = F.TOKEN_COLUMNS
# METRICS.md "Logging checks": by=step and by=run only (token_metrics, summaries' token_table)
CHECK_METRICS = F.CHECK_COLUMNS
# METRICS.md v3 "Residual signatures": by=step and by=run (token_metrics, summaries' token_table)
RESIDUAL_METRICS = F.RESIDUAL_COLUMNS
# the metrics of the per-sequence pass (averaged over sequences); n_sequences is counted there too
SEQUENCE_METRICS = tuple(c for c in F.SEQUENCE_COLUMNS if c != "n_sequences")


def cap_clip_params(cap: float, clip: float) -> dict:
    """The parameters of `token_aggregates`: C, ε and their thresholds on Δ (r > C ⟺ Δ > ln C, r < 1/C ⟺
    Δ < −ln C, |r − 1| > ε ⟺ Δ > ln(1+ε) or Δ < ln(1−ε)): compared in log space, as the summaries do, so both
    count exactly the same tokens."""
    cap, clip = float(cap), float(clip)
    return {"cap": cap, "ln_cap": math.log(cap), "ln_clip_hi": math.log1p(clip),
            "ln_clip_lo": math.log1p(-clip) if clip < 1.0 else -math.inf}


def token_aggregates(cap_param: str = "$cap") -> dict[str, str]:
    """name -> SQL aggregate of each per-token metric over a relation of summaries.compute.token_terms_sql
    (columns s, t, d, r, rm1 = r − 1, k3, k3r, mpe, qs, qt, adp, us = exp s, ut = exp t).

    The terms are the ones the summaries sum, in the same cancellation-free forms (r − 1 by expm1, k3 by its
    series near 0, 1 − p); thresholds are compared on Δ (the parameters of `cap_clip_params`). Exactness on identical log-probs: Δ = 0 gives r = 1, rm1 = k3 = 0 exactly. Spreads that
    could come out as rounding noise are guarded with min = max.
    """
    w = clamp_sql("r", f"1.0 / {cap_param}", cap_param)
    return {
        "n_tokens": "count(*)",
        "kl_k1": "avg(s - t)",
        "kl_k2": "avg(0.5 * d * d)",
        "kl_k3": "avg(k3)",
        "log_ratio_abs_mean": "avg(abs(d))",
        "log_ratio_abs_max": "max(abs(d))",
        "prob_abs_diff_mean": "avg(adp)",
        "prob_abs_diff_max": "max(adp)",
        "prob_pearson": "CASE WHEN min(ut) = max(ut) OR min(us) = max(us) THEN NULL "
                        "ELSE greatest(-1.0, least(1.0, corr(ut, us))) END",  # bounded as the summaries' form
        "ratio_mean": "avg(r)",
        "ratio_std": "CASE WHEN min(r) = max(r) THEN 0.0 ELSE stddev_pop(rm1) END",
        "ratio_min": "min(r)",
        "ratio_max": "max(r)",
        "chi2_token": "avg(rm1 * rm1) + 2.0 * avg(rm1)",
        "ratio_frac_high": "count_if(d > $ln_cap)::DOUBLE / count(*)",
        "ratio_frac_low": "count_if(d < -$ln_cap)::DOUBLE / count(*)",
        "clip_frac": "count_if(d > $ln_clip_hi OR d < $ln_clip_lo)::DOUBLE / count(*)",
        "ess": f"CASE WHEN min({w}) = max({w}) THEN 1.0 ELSE avg({w}) * avg({w}) / avg({w} * {w}) END",
        "mult_prob_error": "1.0 + avg(mpe)",
        "kl_k3_reverse": "avg(k3r)",
    }


def token_aggregates_sql(keys: Sequence[str], cap_param: str = "$cap",
                         only: Sequence[str] | None = None) -> str:
    """Select-list: `keys`, then the per-token aggregates of `token_aggregates` (those in `only` if given)."""
    aggs = [f"{sql} AS {name}" for name, sql in token_aggregates(cap_param).items()
            if only is None or name in only]
    return ",\n        ".join([*keys, *aggs])


def grouped_token_metrics_sql(src: str, keys: Sequence[str], only: Sequence[str] | None = None,
                              sets: Sequence[Sequence[str]] | None = None) -> str:
    """Full METRICS.md token table over `src` (columns: keys..., step, sample, s, t), grouped by `keys`.

    Two GROUP BYs over the same filtered tokens: one per group for the token aggregates, one per sequence
    (run, step, sample) within the group, whose results are then averaged per group. Every query has
    at least one key, so an empty selection gives no row (a global aggregate would give a row of NULLs).
    `only`: just these token metrics (plus n_tokens); without a per-sequence metric among them the query
    skips the per-sequence GROUP BY.
    `sets`: several groupings at once (GROUP BY GROUPING SETS, each a subset of `keys`, one scan of the
    tokens for all): a key outside a row's set is NULL there, and the column grouping_id = GROUPING(keys)
    tells the sets apart (bit i, counted from the last key, set when keys[-1 - i] is not in the set).
    """
    keys = list(keys)
    if not keys:
        raise ValueError("grouped_token_metrics_sql needs at least one group key")
    k = ", ".join(keys)
    group, gid = k, ""
    if sets is not None:
        if not sets or any(not s or not set(s) <= set(keys) for s in sets):
            raise ValueError(f"grouping sets must be non-empty subsets of {keys}, got {sets!r}")
        group = "GROUPING SETS (" + ", ".join(f"({', '.join(s)})" for s in sets) + ")"
        gid = f"GROUPING({k}) AS grouping_id, "
    base = f"""base AS NOT MATERIALIZED ({token_terms_sql("SELECT {seq_keys}, s, t FROM (" + src + ") s_")})"""
    if only is not None and not {"n_sequences", *SEQUENCE_METRICS} & set(only):
        # token aggregates only: one GROUP BY, no per-sequence pass
        return f"""WITH {base.format(seq_keys=k)}
    SELECT {gid}{token_aggregates_sql(keys, only=["n_tokens", *only])} FROM base GROUP BY {group} ORDER BY {k}"""
    extra = [c for c in ("run", "step", "sample") if c not in keys]
    seq_keys = ", ".join(keys + extra)
    on = " AND ".join([f"tok.{c} IS NOT DISTINCT FROM sq.{c}" for c in keys]
                      + (["tok.grouping_id = sq.grouping_id"] if gid else []))
    token_cols_sel = ", ".join(f"{'sq' if m in SEQUENCE_METRICS or m == 'n_sequences' else 'tok'}.{m}"
                               for m in TOKEN_METRICS)
    return f"""
    WITH {base.format(seq_keys=seq_keys)},
    tok AS (SELECT {gid}{token_aggregates_sql(keys)} FROM base GROUP BY {group}),
    seq AS (SELECT {seq_keys}, sum(d) AS sum_d, avg(s - t) AS mean_s_minus_t, avg(d) AS mean_d
            FROM base GROUP BY {seq_keys}),
    -- favg (compensated): the per-sequence rows come out of a parallel GROUP BY in no fixed order, and a
    -- plain avg of them then differed in the last ulp from one run of the same query to the next
    sq AS (SELECT {gid}{k}, count(*) AS n_sequences,
                  favg(exp(mean_s_minus_t)) AS ppl_ratio,
                  favg({expm1_sql(f"exp(2.0 * {clamp_log_ratio_sql('sum_d')})", f"(2.0 * {clamp_log_ratio_sql('sum_d')})")}) AS chi2_seq,
                  max(abs(sum_d)) AS seq_log_ratio_abs_max,
                  favg(exp(mean_d)) AS seq_geo_ratio_mean, min(exp(mean_d)) AS seq_geo_ratio_min,
                  max(exp(mean_d)) AS seq_geo_ratio_max
           FROM seq GROUP BY {group})
    SELECT {'tok.grouping_id, ' if gid else ''}{', '.join('tok.' + c for c in keys)}, {token_cols_sel}
    FROM tok JOIN sq ON {on}
    ORDER BY {'tok.grouping_id, ' if gid else ''}{', '.join('tok.' + c for c in keys)}"""


def check_metrics_sql(src: str, keys: Sequence[str], sets: Sequence[Sequence[str]] | None = None) -> str:
    """METRICS.md "Logging checks" (finalise.CHECK_COLUMNS) per group of `keys` over the token rows of `src`
    (columns: keys..., run, step, sample, pos, s, t), written from their definitions over the tokens (the
    summaries' forms are in finalise.check_sql): ratio_mean_se = sample std of r / √n, missing_mass = −mean(r − 1),
    logprob_slope = covar_pop(s, t) / var_pop(s), logprob_slope_se = √(var_res / ((n − 2) var(s))) with
    var_res = var(Δ) − cov(s, Δ)² / var(s), and the mean |Δ| at lag ∓1 over neighbouring positions of a sequence.
    `sets`: GROUPING SETS as in grouped_token_metrics_sql (with the column grouping_id)."""
    keys = list(keys)
    k = ", ".join(keys)
    group, gid = k, ""
    if sets is not None:
        group = "GROUPING SETS (" + ", ".join(f"({', '.join(s)})" for s in sets) + ")"
        gid = f"GROUPING({k}) AS grouping_id, "
    cols = ", ".join(dict.fromkeys(keys + ["run", "step", "sample", "pos"]))
    slope_ok = "min(s) < max(s) AND var_pop(s) > 0"
    return f"""
    WITH base AS NOT MATERIALIZED ({token_terms_sql(f"SELECT {cols}, s, t FROM ({src}) s_")}),
    w AS (SELECT *, CASE WHEN lead(pos) OVER nb = pos + 1 THEN lead(t) OVER nb END AS nt,
                    CASE WHEN lead(pos) OVER nb = pos + 1 THEN lead(s) OVER nb END AS ns
          FROM base WINDOW nb AS (PARTITION BY run, step, sample ORDER BY pos))
    SELECT {gid}{k},
        CASE WHEN count(*) < 2 THEN NULL WHEN min(r) = max(r) THEN 0.0
             ELSE stddev_samp(rm1) / sqrt(count(*)) END AS ratio_mean_se,
        -avg(rm1) AS missing_mass,
        CASE WHEN {slope_ok} THEN covar_pop(s, t) / var_pop(s) END AS logprob_slope,
        CASE WHEN {slope_ok} AND count(*) >= 3
             THEN sqrt(greatest(var_pop(d) - covar_pop(s, d) * covar_pop(s, d) / var_pop(s), 0.0)
                       / ((count(*) - 2) * var_pop(s))) END AS logprob_slope_se,
        avg(abs(nt - s)) AS lag_abs_delta_prev,
        avg(abs(t - ns)) AS lag_abs_delta_next
    FROM w GROUP BY {group} ORDER BY {'grouping_id, ' if gid else ''}{k}"""


def residual_metrics_sql(src: str, keys: Sequence[str]) -> str:
    """METRICS.md "Residual signatures" (finalise.RESIDUAL_COLUMNS) per group of `keys` over the token rows of
    `src` (columns: keys..., run, step, sample, pos, s, t, segment), from their definitions: first_token_kl_share
    = Σ k3 at pos 0 / Σ k3 (null when 0); lattice_share_q = share of the tokens with Δ ≠ 0 within 1e-6 of a
    multiple of $q; boundary_low_share / elsewhere_low_share = share of Δ < −10 among the tokens at their
    segment's first position (least pos of the sequence's tokens with that segment) / among the other tokens with
    a segment (null without such tokens)."""
    keys = list(keys)
    k = ", ".join(keys)
    cols = ", ".join(dict.fromkeys(keys + ["run", "step", "sample", "pos", "segment"]))
    low, tol = float(S.BOUNDARY_LOW), float(S.LATTICE_TOL)
    first = "segment IS NOT NULL AND pos = first_pos"
    rest = "segment IS NOT NULL AND pos > first_pos"
    return f"""
    WITH base AS ({token_terms_sql(f"SELECT {cols}, s, t FROM ({src}) s_")}),
    w AS (SELECT *, min(pos) OVER (PARTITION BY run, step, sample, segment) AS first_pos FROM base)
    SELECT {k},
        CASE WHEN fsum(k3) > 0 THEN coalesce(fsum(k3) FILTER (WHERE pos = 0), 0.0) / fsum(k3) END
            AS first_token_kl_share,
        count_if(d <> 0 AND abs(d / $q - round(d / $q)) < {tol!r}) / nullif(count_if(d <> 0), 0)
            AS lattice_share_q,
        count_if({first} AND d < {low!r}) / nullif(count_if({first}), 0) AS boundary_low_share,
        count_if({rest} AND d < {low!r}) / nullif(count_if({rest}), 0) AS elsewhere_low_share
    FROM w GROUP BY {k} ORDER BY {k}"""


def _segment_sql(store: Store) -> str:
    """The tokens' segment column, or NULL where the database predates it (opened read-only, not migrated)."""
    return "segment" if store.has_columns("tokens", ["segment"]) else "NULL::INTEGER AS segment"


def residual_metrics(store: Store, runs: list[str], by: str = "step", q: float = S.LATTICE_Q,
                     steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """RESIDUAL_METRICS per (run, step) or per run from the token rows, for any quantum q > 0 of
    lattice_share_q (the summaries answer q = schema.LATTICE_Q only). Exact where the token rows are complete;
    over a DriftLogger sample of them otherwise (metrics.read.coverage)."""
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    q = float(q)
    if not math.isfinite(q) or q <= 0:
        raise ValueError(f"q: expected a quantum > 0, got {q!r}")
    runs = check_runs(runs)
    where, params = token_filter(store, runs, steps)
    keys = ["run", "step"] if by == "step" else ["run"]
    src = (f"SELECT run, step, sample, pos, {_segment_sql(store)}, sampler_logprob AS s, trainer_logprob AS t "
           f"FROM tokens WHERE {where}")
    return store.sql(residual_metrics_sql(src, keys), params | {"q": q})


# -- public metrics ----------------------------------------------------------------------------------

def token_metrics(store: Store, runs: list[str], by: str = "step", cap: float = 2.0, clip: float = 0.2,
                  steps: tuple[int, int] | None = None) -> pl.DataFrame:
    r"""Token mismatch metrics of METRICS.md per (run, step) (`by="step"`) or per run (`by="run"`).

    With Δ = t − s and r = exp(clamp(Δ, −20, 20)), over the tokens of the group (sampled from π_sampler):

    .. math::
        kl\_k1 = \overline{s - t},\quad kl\_k2 = \overline{\Delta^2/2},\quad kl\_k3 = \overline{r - 1 - \Delta}

    kl_k1 (unbiased, may be negative) and kl_k3 (≥ 0, low variance; a term that rounds below 0 counts as 0)
    estimate KL(π_sampler ‖ π_trainer);
    ratio_* describe r = π_trainer/π_sampler (ratio_std is the population std); chi2_token = mean(r²) − 1;
    ratio_frac_high/low = fraction with r > C / r < 1/C; clip_frac = fraction with |r − 1| > ε;
    ess = (mean w)² / mean(w²) with w = clamp(r, 1/C, C); prob_pearson = corr(exp t, exp s), null when either
    column is constant (and for one token). Per sequence (run, step, sample), then averaged over sequences:
    ppl_ratio = exp(mean s − mean t), chi2_seq = exp(2·clamp(ΣΔ, −20, 20)) − 1; seq_log_ratio_abs_max = max |ΣΔ|.
    Version 2: mult_prob_error = mean exp(|clamp(Δ)|) (NeMo RL); kl_k3_reverse = mean(1/r − 1 + Δ) ≥ 0, still
    over the sampler's tokens; seq_geo_ratio_mean/min/max = mean/min/max over sequences of g = exp(mean_tok Δ).

    Returns one row per non-empty group: [run, (step,) n_tokens, n_sequences, kl_k1, ..., seq_log_ratio_abs_max].

    Example: one token with s = log 0.5, t = log 0.25 gives kl_k1 = log 2 ≈ 0.693, ratio_mean = 0.5,
    kl_k3 = 0.5 − 1 + log 2 ≈ 0.193, ratio_frac_low = 0 for C = 2 (0.5 is not < 1/2).
    """
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    check_cap_clip(cap, clip)
    runs = check_runs(runs)
    where, params = token_filter(store, runs, steps)
    keys = ["run", "step"] if by == "step" else ["run"]
    src = f"SELECT run, step, sample, pos, sampler_logprob AS s, trainer_logprob AS t FROM tokens WHERE {where}"
    params.update(cap_clip_params(cap, clip))
    df = store.sql(grouped_token_metrics_sql(src, keys), params)
    checks = store.sql(check_metrics_sql(src, keys), {k: v for k, v in params.items() if f"${k}" in src})
    residual = residual_metrics(store, runs, by=by, steps=steps)
    return df.join(checks, on=keys, how="left", maintain_order="left").join(
        residual, on=keys, how="left", maintain_order="left")


def token_metrics_by_run_and_step(store: Store, runs: list[str], cap: float = 2.0, clip: float = 0.2,
                                  steps: tuple[int, int] | None = None) -> dict[str, pl.DataFrame]:
    """{"run": token_metrics(by="run"), "step": token_metrics(by="step")} from one scan of the tokens
    (GROUP BY GROUPING SETS): the same columns, dtypes, order and aggregates as the two calls."""
    check_cap_clip(cap, clip)
    runs = check_runs(runs)
    where, params = token_filter(store, runs, steps)
    src = f"SELECT run, step, sample, pos, sampler_logprob AS s, trainer_logprob AS t FROM tokens WHERE {where}"
    params.update(cap_clip_params(cap, clip))
    sets = [["run"], ["run", "step"]]
    df = store.sql(grouped_token_metrics_sql(src, ["run", "step"], sets=sets), params)
    checks = store.sql(check_metrics_sql(src, ["run", "step"], sets=sets),
                       {k: v for k, v in params.items() if f"${k}" in src})
    keys = ["grouping_id", "run", "step"]
    df = df.join(checks, on=keys, how="left", maintain_order="left", nulls_equal=True)
    # GROUPING(run, step): 1 where step is rolled up (the per-run rows), 0 for the per-step rows
    by_run = df.filter(pl.col("grouping_id") == 1).drop("grouping_id", "step")
    by_step = df.filter(pl.col("grouping_id") == 0).drop("grouping_id")
    keys = {"run": ["run"], "step": ["run", "step"]}
    return {by: d.join(residual_metrics(store, runs, by=by, steps=steps), on=keys[by], how="left",
                       maintain_order="left") for by, d in (("run", by_run), ("step", by_step))}


def default_taus() -> list[float]:
    """Log grid from 1.01 to 1000 (49 points): the thresholds of the extreme-token curve."""
    return list(TAUS)


def extreme_token_curve(store: Store, runs: list[str], taus: Sequence[float] | None = None,
                        steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """R3's extreme-token curve F(τ) = fraction of tokens with max(r, 1/r) > τ, per run.

    r = exp(clamp(Δ, −20, 20)) is the importance ratio π_trainer/π_sampler; max(r, 1/r) measures the
    mismatch in either direction. One pass over the tokens counts every threshold at once.
    Returns [run, tau, frac], taus ascending; runs without tokens in range give no rows.

    Example: tokens with r = 1, 1.5, 4 give F(1.2) = 2/3, F(2) = 1/3, F(5) = 0.
    """
    runs = check_runs(runs)
    taus = sorted(float(x) for x in (default_taus() if taus is None else taus))
    if not taus:
        return pl.DataFrame(schema={"run": pl.String, "tau": pl.Float64, "frac": pl.Float64})
    where, params = token_filter(store, runs, steps)
    names = []
    for i, tau in enumerate(taus):
        params[f"tau{i}"] = math.log(tau)
        names.append(f"tau{i}")
    # max(r, 1/r) > τ ⟺ |clamp(Δ)| > ln τ (compared in log space, as the summaries' Δ bins do);
    # per token, c = #{i: |clamp Δ| > ln τ_i} by binary search over the sorted τ (6 comparisons for 49 τ, not 49);
    # F(τ_i) = #{tokens with c > i} / n follows from the few (run, c) counts
    counts = store.sql(f"""
        SELECT run, {count_below_sql("m", names)} AS c, count(*) AS n
        FROM (SELECT run, abs({clamp_log_ratio_sql('trainer_logprob - sampler_logprob')}) AS m
              FROM tokens WHERE {where})
        GROUP BY ALL""", params)
    return extreme_from_counts(counts, taus)


def extreme_from_counts(counts: pl.DataFrame, taus: Sequence[float]) -> pl.DataFrame:
    """F(τ) per run from token counts per (run, c), c = #{i: max(r, 1/r) > τ_i} over the ascending `taus`."""
    if counts.height == 0:
        return pl.DataFrame(schema={"run": pl.String, "tau": pl.Float64, "frac": pl.Float64})
    out_run, out_tau, out_frac = [], [], []
    for (run,), g in counts.sort("run").group_by("run", maintain_order=True):
        per_c = np.zeros(len(taus) + 1, dtype=np.int64)
        np.add.at(per_c, g["c"].to_numpy(), g["n"].to_numpy())
        above = np.cumsum(per_c[::-1])[::-1]  # above[j] = #{tokens with c >= j}
        total = int(above[0])
        out_run += [run] * len(taus)
        out_tau += list(taus)
        out_frac += [int(above[i + 1]) / total for i in range(len(taus))]
    return pl.DataFrame({"run": out_run, "tau": out_tau, "frac": out_frac},
                        schema={"run": pl.String, "tau": pl.Float64, "frac": pl.Float64})
