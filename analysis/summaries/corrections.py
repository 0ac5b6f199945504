"""The per-sequence pass of analysis/metrics/corrections.py from summary rows instead of token rows.

A correction needs, per sequence, its aggregates of Δ (sum, mean, min: the sequence rules) and, per method, the
count and weight sums of the tokens its token rule keeps. `summary_seq` has the first; `summary_seq_band` splits a
sequence's tokens by ratio band on schema.BAND_EDGES with n, Σ(r − 1) and Σ(r − 1)² per band, which gives the
second exactly whenever the rule's thresholds (icepop's ln alpha and ln beta, the ESS clamp ±ln 2) lie on band
edges: a band is then wholly masked or kept, wholly below, inside or above the clamp, and per band

    Σ r = n + Σ(r − 1),    Σ r² = n + 2 Σ(r − 1) + Σ(r − 1)²    (the ESS weights: r within [1/2, 2]).

Rounding: n + Σ(r − 1) carries an absolute error of a few ε per token, so the weight sums are exact to
rel ~ε / mean(r): below 1e-12 unless nearly all of a group's kept tokens have r < 1e-4 (weight_mean is then off
by ~1e-16 absolute). Σ r² cancels where r ≪ 1, which the ESS clamp keeps out; tis's weights min(r, C) are not
clamped below, so tis reads token rows (analysis.metrics.corrections.reads_tokens).

Cost follows sequences × bands, not tokens, and every token counts even where token rows are a sample.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

from analysis.summaries import schema as S
from analysis.summaries.sql import clamp_log_ratio_sql

ESS_CAP = 2.0  # the ESS clamp of the masking methods (analysis.metrics.corrections.ESS_CAP)
NEVER_BELOW, NEVER_ABOVE = -1, S.N_BANDS  # band ids no band is below / above


def _bin_below(x: float) -> int:
    """Bands whose tokens have clamp(d) < x are those with band < the returned id (x on an edge or beyond the clamp)."""
    if x <= -S.CLAMP:
        return NEVER_BELOW + 1  # clamp(d) ≥ −CLAMP: nothing is below (band < 0 is empty)
    if x > S.CLAMP:
        return NEVER_ABOVE + 1  # clamp(d) ≤ CLAMP < x: every band
    return 2 * S.BAND_EDGES.index(x) + 1


def _bin_above(x: float) -> int:
    """Bands whose tokens have clamp(d) > x are those with band > the returned id."""
    if x >= S.CLAMP:
        return NEVER_ABOVE  # nothing is above
    if x < -S.CLAMP:
        return NEVER_BELOW  # every band
    return 2 * S.BAND_EDGES.index(x) + 1


def icepop_params(i: int, values: Mapping[str, float], log_threshold: Callable[[float], float]) -> dict:
    """Query parameters of choice i's icepop rule on bands (`$m<i>_...`): its masked bands are band < lo_bin and
    band > hi_bin. `log_threshold` maps alpha and beta to the ln the token rows compare with (an edge of
    BAND_EDGES, or beyond the clamp: analysis.metrics.corrections.reads_tokens)."""
    return {f"m{i}_lo_bin": _bin_below(log_threshold(values["alpha"])),
            f"m{i}_hi_bin": _bin_above(log_threshold(values["beta"]))}


def shared_params() -> dict:
    """Parameters every pass shares: the bands of the ESS clamp [1/2, 2]."""
    return {"ess_lo_bin": _bin_below(-math.log(ESS_CAP)), "ess_hi_bin": _bin_above(math.log(ESS_CAP))}


def _band_sums(i: int, method: str) -> str:
    """Per sequence, method i's token-rule sums over its bands (`bd`: band, n, s1 = Σ(r − 1), s2 = Σ(r − 1)²), the
    columns the token pass computes per sequence: n_tok_masked, sum_weight (Σ r kept), n_kept, sw and sw2 (Σ of the
    ESS weight clamp(r, 1/2, 2) and of its square over kept tokens)."""
    r_sum, r2_sum = "(n + s1)", "(n + 2.0 * s1 + s2)"
    masked = f"(band < $m{i}_lo_bin OR band > $m{i}_hi_bin)" if method == "icepop" else "FALSE"
    lo, hi = 1.0 / ESS_CAP, ESS_CAP
    w = f"CASE WHEN band < $ess_lo_bin THEN {lo} * n WHEN band > $ess_hi_bin THEN {hi} * n ELSE {r_sum} END"
    w2 = (f"CASE WHEN band < $ess_lo_bin THEN {lo * lo} * n WHEN band > $ess_hi_bin THEN {hi * hi} * n "
          f"ELSE {r2_sum} END")
    kept = f"NOT {masked}"
    return f"""coalesce(sum(n) FILTER (WHERE {masked}), 0)::BIGINT AS n_tok_masked{i},
               coalesce(fsum({r_sum}) FILTER (WHERE {kept}), 0.0) AS sum_weight{i},
               coalesce(sum(n) FILTER (WHERE {kept}), 0)::BIGINT AS n_kept{i},
               coalesce(fsum({w}) FILTER (WHERE {kept}), 0.0) AS sw{i},
               coalesce(fsum({w2}) FILTER (WHERE {kept}), 0.0) AS sw2{i}"""


def seq_ctes(methods: Sequence[str], where: str) -> str:
    """CTEs ending in `seq`: one row per sequence of the summary rows matching `where` (a sequence's rows of every
    file merged) with n_tok, sum_d, mean_d, min_r and, per method i, the token-rule sums of `_band_sums`."""
    cd_min = clamp_log_ratio_sql("min_d")
    return f"""sq AS (SELECT run, step, sample, sum(n_tokens)::BIGINT AS n_tok, fsum(sum_d) AS sum_d,
                          min(min_d) AS min_d
                   FROM summary_seq WHERE {where} GROUP BY run, step, sample HAVING sum(n_tokens) > 0),
        bd AS (SELECT run, step, sample, band, sum(n_tokens)::BIGINT AS n, fsum(sum_rm1) AS s1,
                      fsum(sum_rm1_sq) AS s2
               FROM summary_seq_band WHERE {where} GROUP BY run, step, sample, band),
        tb AS (SELECT run, step, sample, {', '.join(_band_sums(i, m) for i, m in enumerate(methods))}
               FROM bd GROUP BY run, step, sample),
        seq AS (SELECT sq.run, sq.step, sq.sample, sq.n_tok, sq.sum_d, sq.sum_d / sq.n_tok AS mean_d,
                       exp({cd_min}) AS min_r, tb.* EXCLUDE (run, step, sample)
                FROM sq JOIN tb ON tb.run = sq.run AND tb.step = sq.step AND tb.sample = sq.sample)"""
