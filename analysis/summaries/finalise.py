"""METRICS.md columns from summary rows: the one place where the formulas meet the summaries.

Every function merges the partial rows of the selected (run, step) range by SUM / MIN / MAX over the wanted
group (a step, a run, a layer, a bucket), then applies the definitions. The sums were taken in forms that do
not cancel (schema.py): r − 1 rather than r, 1 − p rather than p, k3 by its series near 0.
"""
from __future__ import annotations

import math
from typing import Sequence

from analysis.summaries import schema as S
from analysis.summaries.margins import margin_mean_sql
from analysis.summaries.sql import bucket_sql, clamp_log_ratio_sql, clamp_sql, ratio_sql

# METRICS.md v2 token columns, in the order the tables return them
TOKEN_COLUMNS = (
    "n_tokens", "n_sequences", "kl_k1", "kl_k2", "kl_k3", "log_ratio_abs_mean", "log_ratio_abs_max",
    "prob_abs_diff_mean", "prob_abs_diff_max", "prob_pearson", "ratio_mean", "ratio_std", "ratio_min",
    "ratio_max", "chi2_token", "ratio_frac_high", "ratio_frac_low", "clip_frac", "ess", "ppl_ratio", "chi2_seq",
    "seq_log_ratio_abs_max", "mult_prob_error", "kl_k3_reverse", "seq_geo_ratio_mean", "seq_geo_ratio_min",
    "seq_geo_ratio_max",
)
SEQUENCE_COLUMNS = ("n_sequences", "ppl_ratio", "chi2_seq", "seq_log_ratio_abs_max", "seq_geo_ratio_mean",
                    "seq_geo_ratio_min", "seq_geo_ratio_max")
FLIP_COLUMNS = ("token_any_flip_rate", "flipped_layers_per_token")
# METRICS.md "Logging checks" (by=step and by=run only: from summary_step's CHECK_SUMS and ratio sums), plus the
# standard error of the slope that the temperature check reads
CHECK_COLUMNS = ("ratio_mean_se", "missing_mass", "logprob_slope", "logprob_slope_se", "lag_abs_delta_prev",
                 "lag_abs_delta_next")
# METRICS.md v3 "Residual signatures" (by=step and by=run): from summary_step's RESIDUAL_SUMS, and Σ k3 of the
# position bucket 0 of summary_bucket. lattice_share_q is for q = schema.LATTICE_Q (other q: token rows,
# analysis/metrics/token.py lattice_share); elsewhere_low_share is boundary_low_share's "same share elsewhere"
RESIDUAL_COLUMNS = ("first_token_kl_share", "lattice_share_q", "boundary_low_share", "elsewhere_low_share")
# METRICS.md v3 "Full distribution" (by=step and by=run: from summary_step's TOPK_SUMS), means over the positions
# with top-k lists of both sides; null where a group has none
TOPK_COLUMNS = ("topk_overlap", "top1_agree", "topk_mass_sampler", "topk_mass_trainer", "topk_kl_shared",
                "topk_tv_lower", "topk_tv_upper")
# METRICS.md v3 "Routing margins and weights" (by=layer: from summary_layer's WEIGHT_SUMS)
WEIGHT_COLUMNS = ("weight_abs_diff_mean", "weight_abs_diff_max")


def summarised(cap: float, clip: float) -> bool:
    """Whether C and ε are among the values the summaries answer exactly (schema.CAPS, schema.CLIPS)."""
    return float(cap) in S.CAPS and float(clip) in S.CLIPS


def edge_bin(x: float, edges: Sequence[float]) -> int:
    """The odd bin id of the edge x (schema bin convention): 2·index + 1."""
    return 2 * list(edges).index(x) + 1


def merged(table: str, keys: Sequence[str], where: str, source: str | None = None,
           without: Sequence[str] = ()) -> str:
    """SELECT keys, merged columns FROM table WHERE where GROUP BY keys (sums add, minima and maxima merge).
    `source`: a subquery with the table's columns (and the keys) to read instead of the table itself;
    `without`: columns to leave out (those a database made before them lacks)."""
    src = f"({source}) src_" if source else table
    cols = [c for c in S.columns(table) if S.merge_kind(c) != "key" and c not in without]
    return (f"SELECT {', '.join(keys)}, {S.merge_list(table, cols)} FROM {src} WHERE {where} "
            f"GROUP BY {', '.join(keys)}")


def check_sql(checks: bool = True) -> str:
    """Select-list of CHECK_COLUMNS over a merged summary_step relation (aliased m), METRICS.md "Logging checks".

    With r − 1 summed as rm1 and n tokens: missing_mass = −Σ rm1 / n (1 − ratio_mean, without its cancellation),
    ratio_mean_se = √(s² / n) with the sample variance s² = (Σ rm1² − (Σ rm1)² / n) / (n − 1). With Δ = t − s:
    logprob_slope = cov(s, t) / var(s) = 1 + cov(s, Δ) / var(s) (population moments; the second form does not
    cancel when t ≈ s), logprob_slope_se = √(var_res / ((n − 2) var(s))) with var_res = var(Δ) − cov(s, Δ)² / var(s)
    the residual variance of the least-squares line of t on s; lag_abs_delta_prev / _next = Σ |Δ| at lag ∓1 over
    the adjacent pairs / their number. Slope and lags are null unless CHECK_SUMS cover every token of the group
    (rows written before them hold nulls); checks=False: the database has no such columns (opened read-only)."""
    n = "m.n_tokens::DOUBLE"
    c = float(S.CLAMP)
    r_of = lambda d: f"exp(CASE WHEN {d} < -{c} THEN -{c} WHEN {d} > {c} THEN {c} ELSE {d} END)"
    var_r = f"((m.sum_rm1_sq - m.sum_rm1 * m.sum_rm1 / {n}) / ({n} - 1.0))"
    se = f"""CASE WHEN m.n_tokens < 2 THEN NULL WHEN {r_of('m.min_d')} = {r_of('m.max_d')} THEN 0.0
                  ELSE sqrt(greatest({var_r}, 0.0) / {n}) END AS ratio_mean_se"""
    head = [se, f"-m.sum_rm1 / {n} AS missing_mass"]
    if not checks:
        return ",\n".join(head + [f"NULL::DOUBLE AS {col}" for col in CHECK_COLUMNS[2:]])
    covered = "coalesce(m.n_check_tokens, 0) = m.n_tokens"
    var_s = f"(m.sum_s2 / {n} - (m.sum_s / {n}) * (m.sum_s / {n}))"
    cov_sd = f"(m.sum_sd / {n} - (m.sum_s / {n}) * (m.sum_d / {n}))"
    var_d = f"(m.sum_d2 / {n} - (m.sum_d / {n}) * (m.sum_d / {n}))"
    slope_ok = f"{covered} AND m.min_s < m.max_s AND {var_s} > 0"
    return ",\n".join(head + [
        f"CASE WHEN {slope_ok} THEN 1.0 + {cov_sd} / {var_s} END AS logprob_slope",
        f"""CASE WHEN {slope_ok} AND m.n_tokens >= 3
                 THEN sqrt(greatest({var_d} - {cov_sd} * {cov_sd} / {var_s}, 0.0) / (({n} - 2.0) * {var_s}))
                 END AS logprob_slope_se""",
        f"CASE WHEN {covered} AND m.n_adj > 0 THEN m.sum_abs_lag_prev / m.n_adj END AS lag_abs_delta_prev",
        f"CASE WHEN {covered} AND m.n_adj > 0 THEN m.sum_abs_lag_next / m.n_adj END AS lag_abs_delta_next",
    ])


def residual_sql(residual: bool = True) -> str:
    """Select-list of RESIDUAL_COLUMNS over a merged summary_step relation (aliased m) and Σ k3 at position 0
    (f.sum_k3, null where no token sits there). first_token_kl_share = Σ k3 at position 0 / Σ k3 (null when the
    sum is 0); lattice_share_q = n_lattice / n_d_nonzero; boundary_low_share = n_seg_first_low / n_seg_first;
    elsewhere_low_share = n_seg_rest_low / (n_seg_tokens − n_seg_first). The counts' shares are null unless
    RESIDUAL_SUMS cover every token of the group (rows written before them hold nulls) or the denominator is 0;
    residual=False: the database has no such columns (opened read-only)."""
    first = "CASE WHEN m.sum_k3 > 0 THEN coalesce(f.sum_k3, 0.0) / m.sum_k3 END AS first_token_kl_share"
    if not residual:
        return ",\n".join([first] + [f"NULL::DOUBLE AS {col}" for col in RESIDUAL_COLUMNS[1:]])
    covered = "coalesce(m.n_res_tokens, 0) = m.n_tokens"
    share = lambda num, den, name: f"CASE WHEN {covered} AND {den} > 0 THEN {num}::DOUBLE / {den} END AS {name}"
    return ",\n".join([first, share("m.n_lattice", "m.n_d_nonzero", "lattice_share_q"),
                       share("m.n_seg_first_low", "m.n_seg_first", "boundary_low_share"),
                       share("m.n_seg_rest_low", "(m.n_seg_tokens - m.n_seg_first)", "elsewhere_low_share")])


def first_position_sql(keys: Sequence[str], where: str) -> str:
    """Σ k3 of the tokens at response position 0 per group of `keys`: position bucket 0 of summary_bucket."""
    return (f"SELECT {', '.join(keys)}, fsum(sum_k3) AS sum_k3 FROM summary_bucket WHERE {where} "
            f"AND dim = 'position' AND bucket = 0 GROUP BY {', '.join(keys)}")


def topk_sql(topk: bool = True) -> str:
    """Select-list of TOPK_COLUMNS over a merged summary_step relation (aliased m): each sum of TOPK_SUMS over
    n_topk, null where n_topk is 0 or null; topk=False: the database has no such columns (opened read-only)."""
    if not topk:
        return ",\n".join(f"NULL::DOUBLE AS {c}" for c in TOPK_COLUMNS)
    sums = dict(zip(TOPK_COLUMNS, S.TOPK_SUM_NAMES[1:]))
    return ",\n".join(f"m.{v}::DOUBLE / nullif(m.n_topk, 0) AS {c}" for c, v in sums.items())


def topk_table_sql(keys: Sequence[str], where: str) -> str:
    """[keys, TOPK_COLUMNS] per group of `keys` over the summary_step rows matching `where` (for token tables
    computed from token rows, whose top-k columns still come from the summaries: they do not depend on C or ε)."""
    k = ", ".join(keys)
    return f"""SELECT {k}, {topk_sql()} FROM ({merged('summary_step', keys, where,
                                                     without=[c for c in S.columns('summary_step')
                                                              if c not in S.TOPK_SUM_NAMES])}) m"""


def topk_by_sql(dimension: str, where: str, tag_where: str | None = None) -> str:
    """The full-distribution columns (TOPK_COLUMNS, METRICS.md v3) per (run, bucket) of a sequence property, with
    the sampled-token kl_k3 and log_ratio_abs_mean of the same sequences beside them, from summary_seq (a
    sequence's rows of every file merged first). dimension "length": bucket_sql('length') of 1 + max pos;
    "tag": the sequence's tag from `sequences` (rows matching `tag_where`; untagged sequences left out).
    Returns [run, bucket, n_sequences, n_tokens, kl_k3, log_ratio_abs_mean, n_topk, TOPK_COLUMNS]; the topk
    columns are null where a bucket's sequences have no top-k lists."""
    topk = ", ".join(f"{S.merge_sql('summary_seq', c)} AS {c}" for c in S.TOPK_SUM_NAMES)
    seqs = f"""SELECT run, step, sample, max(max_pos) + 1 AS length, sum(n_tokens)::BIGINT AS n_tokens,
                      fsum(sum_k3) AS sum_k3, fsum(sum_abs_d) AS sum_abs_d, {topk}
               FROM summary_seq WHERE {where} GROUP BY run, step, sample HAVING sum(n_tokens) > 0"""
    if dimension == "length":
        src = f"SELECT *, {bucket_sql('length')} AS bucket FROM ({seqs}) q_"
    elif dimension == "tag":
        src = (f"SELECT q_.*, t_.tag AS bucket FROM ({seqs}) q_ JOIN (SELECT run, step, sample, tag FROM sequences "
               f"WHERE {tag_where} AND tag IS NOT NULL) t_ USING (run, step, sample)")
    else:
        raise ValueError(f"dimension must be 'length' or 'tag', got {dimension!r}")
    sums = dict(zip(TOPK_COLUMNS, S.TOPK_SUM_NAMES[1:]))
    cols = ", ".join(f"fsum({v}) / nullif(sum(n_topk), 0) AS {c}" for c, v in sums.items())
    return f"""SELECT run, bucket, count(*) AS n_sequences, sum(n_tokens)::BIGINT AS n_tokens,
                      fsum(sum_k3) / sum(n_tokens) AS kl_k3, fsum(sum_abs_d) / sum(n_tokens) AS log_ratio_abs_mean,
                      coalesce(sum(n_topk), 0)::BIGINT AS n_topk, {cols}
               FROM ({src}) GROUP BY run, bucket ORDER BY run, bucket"""


def token_sql(keys: Sequence[str]) -> str:
    """Select-list of the token columns over a merged relation with TOKEN_SUMS (aliased m) and the cap/clip
    counts of `threshold_sql` (aliased h): everything but the sequence columns."""
    n = "m.n_tokens::DOUBLE"
    w_of = lambda d: clamp_sql(ratio_sql(d), "1.0 / $cap", "$cap")
    # the moments around p = 0 or around p = 1, whichever the sampler's mean probability is nearer
    near0 = f"(m.sum_ps <= 0.5 * {n})"
    pick = lambda p, q: f"(CASE WHEN {near0} THEN {p} ELSE {q} END)"
    vx = pick(f"(m.sum_ps2 - m.sum_ps * m.sum_ps / {n})", f"(m.sum_qs2 - m.sum_qs * m.sum_qs / {n})")
    vy = pick(f"(m.sum_pt2 - m.sum_pt * m.sum_pt / {n})", f"(m.sum_qt2 - m.sum_qt * m.sum_qt / {n})")
    cov = pick(f"(m.sum_pspt - m.sum_ps * m.sum_pt / {n})", f"(m.sum_qsqt - m.sum_qs * m.sum_qt / {n})")
    var_r = f"(m.sum_rm1_sq / {n} - (m.sum_rm1 / {n}) * (m.sum_rm1 / {n}))"
    return ",\n".join([
        *(f"m.{k}" for k in keys), "m.n_tokens",
        f"-m.sum_d / {n} AS kl_k1",
        f"0.5 * m.sum_d2 / {n} AS kl_k2",
        f"m.sum_k3 / {n} AS kl_k3",
        f"m.sum_abs_d / {n} AS log_ratio_abs_mean",
        "m.max_abs_d AS log_ratio_abs_max",
        f"m.sum_adp / {n} AS prob_abs_diff_mean",
        "m.max_adp AS prob_abs_diff_max",
        # corr(exp t, exp s) = corr(1 − exp t, 1 − exp s); null when either column is constant. Bounded to
        # [−1, 1] as numpy's corrcoef is: where a column barely varies, rounding of the moments can push it past
        # (tokens (s, t) = (0, 0) and (−1, −2e−14) gave 1.0028; tests/test_metrics_properties.py)
        f"""CASE WHEN exp(m.min_s) = exp(m.max_s) OR exp(m.min_t) = exp(m.max_t) OR {vx} <= 0 OR {vy} <= 0
                 THEN NULL ELSE greatest(-1.0, least(1.0, {cov} / sqrt({vx} * {vy}))) END AS prob_pearson""",
        f"1.0 + m.sum_rm1 / {n} AS ratio_mean",
        f"CASE WHEN {ratio_sql('m.min_d')} = {ratio_sql('m.max_d')} THEN 0.0 ELSE sqrt(greatest({var_r}, 0.0)) END AS ratio_std",
        f"{ratio_sql('m.min_d')} AS ratio_min",
        f"{ratio_sql('m.max_d')} AS ratio_max",
        f"m.sum_rm1_sq / {n} + 2.0 * m.sum_rm1 / {n} AS chi2_token",
        f"h.n_high / {n} AS ratio_frac_high",
        f"h.n_low / {n} AS ratio_frac_low",
        f"h.n_clip / {n} AS clip_frac",
        # w = clamp(r, 1/C, C): Σ(w − 1) = A and Σ(w − 1)² = B from the bins; ess = (n + A)² / (n (n + 2A + B))
        f"""CASE WHEN {w_of('m.min_d')} = {w_of('m.max_d')} THEN 1.0 ELSE
                 (m.n_tokens + h.a) * (m.n_tokens + h.a) / ({n} * (m.n_tokens + 2.0 * h.a + h.b)) END AS ess""",
        f"1.0 + m.sum_mpe / {n} AS mult_prob_error",
        f"m.sum_k3r / {n} AS kl_k3_reverse",
    ])


def threshold_sql(table: str, keys: Sequence[str], where: str, bin_col: str) -> str:
    """Per group of `keys`: n_high (d > ln C), n_low (d < −ln C), n_clip (d > ln(1+ε) or d < ln(1−ε)), and
    a = Σ(w − 1), b = Σ(w − 1)² for w = clamp(r, 1/C, C), from rows binned on `bin_col` (parameters of
    `threshold_params`)."""
    return f"""SELECT {', '.join(keys)},
        coalesce(sum(n_tokens) FILTER (WHERE {bin_col} > $hi_bin), 0)::DOUBLE AS n_high,
        coalesce(sum(n_tokens) FILTER (WHERE {bin_col} < $lo_bin), 0)::DOUBLE AS n_low,
        coalesce(sum(n_tokens) FILTER (WHERE {bin_col} > $clip_hi_bin OR {bin_col} < $clip_lo_bin), 0)::DOUBLE AS n_clip,
        coalesce(fsum(sum_rm1) FILTER (WHERE {bin_col} BETWEEN $lo_bin AND $hi_bin), 0)
          + coalesce(sum(n_tokens) FILTER (WHERE {bin_col} < $lo_bin), 0) * (1.0 / $cap - 1.0)
          + coalesce(sum(n_tokens) FILTER (WHERE {bin_col} > $hi_bin), 0) * ($cap - 1.0) AS a,
        coalesce(fsum(sum_rm1_sq) FILTER (WHERE {bin_col} BETWEEN $lo_bin AND $hi_bin), 0)
          + coalesce(sum(n_tokens) FILTER (WHERE {bin_col} < $lo_bin), 0) * (1.0 / $cap - 1.0) * (1.0 / $cap - 1.0)
          + coalesce(sum(n_tokens) FILTER (WHERE {bin_col} > $hi_bin), 0) * ($cap - 1.0) * ($cap - 1.0) AS b
        FROM {table} WHERE {where} GROUP BY {', '.join(keys)}"""


def threshold_params(cap: float, clip: float, edges: Sequence[float]) -> dict:
    """Bin ids of ln C, −ln C, ln(1+ε), ln(1−ε) on `edges` (schema.D_EDGES or BAND_EDGES), plus $cap."""
    cap, clip = float(cap), float(clip)
    return {"cap": cap, "hi_bin": edge_bin(math.log(cap), edges), "lo_bin": edge_bin(-math.log(cap), edges),
            "clip_hi_bin": edge_bin(math.log1p(clip), edges), "clip_lo_bin": edge_bin(math.log1p(-clip), edges)}


def sequences_sql(where: str) -> str:
    """One row per sequence with tokens, its rows of every file merged: [run, step, sample, n_tokens (DOUBLE),
    sum_d, length (= 1 + max pos)]. The one place the per-sequence merge is written; readers take what they need."""
    return f"""SELECT run, step, sample, sum(n_tokens)::DOUBLE AS n_tokens, fsum(sum_d) AS sum_d,
                      max(max_pos) + 1 AS length
               FROM summary_seq WHERE {where} GROUP BY run, step, sample HAVING sum(n_tokens) > 0"""


def sequence_sql(keys: Sequence[str], where: str, length_bucket: str | None = None,
                 buckets: str | None = None) -> str:
    """Per group of `keys` (a subset of run, step, and `bucket` with length_bucket or buckets): the sequence
    columns over whole sequences (a sequence's rows from every file merged first). length_bucket: SQL of the
    bucket of a sequence's response length `length` (= 1 + its max pos); buckets: a relation (run, step, sample,
    bucket) giving each sequence's bucket instead (sequences without one are left out)."""
    if buckets is None:
        per_sequence = f"(SELECT *, n_tokens AS n, {length_bucket or 'NULL'} AS bucket FROM ({sequences_sql(where)}) sq_)"
    else:
        per_sequence = (f"(SELECT sq_.*, sq_.n_tokens AS n, k_.bucket FROM ({sequences_sql(where)}) sq_ "
                        f"JOIN ({buckets}) k_ USING (run, step, sample))")
    cs = clamp_log_ratio_sql("sum_d")
    u = f"exp(2.0 * {cs})"
    expm1_2cs = f"(CASE WHEN {u} = 1.0 THEN 2.0 * {cs} ELSE ({u} - 1.0) * 2.0 * {cs} / ln({u}) END)"
    return f"""SELECT {', '.join(keys)}, count(*) AS n_sequences,
               avg(exp(-sum_d / n)) AS ppl_ratio,
               avg({expm1_2cs}) AS chi2_seq,
               max(abs(sum_d)) AS seq_log_ratio_abs_max,
               avg(exp(sum_d / n)) AS seq_geo_ratio_mean,
               min(exp(sum_d / n)) AS seq_geo_ratio_min,
               max(exp(sum_d / n)) AS seq_geo_ratio_max
        FROM {per_sequence} sb_
        GROUP BY {', '.join(keys)}"""


def token_table_sql(keys: Sequence[str], where: str, flips: bool = True, checks: bool = True,
                    residual: bool = True, topk: bool = True) -> str:
    """The METRICS.md token table (TOKEN_COLUMNS, CHECK_COLUMNS, RESIDUAL_COLUMNS, TOPK_COLUMNS, plus FLIP_COLUMNS
    with flips=True) per group of `keys` (("run",) or ("run", "step")) over the summary rows matching `where`.
    Parameters: `threshold_params`. checks=False / residual=False / topk=False: summary_step has no CHECK_SUMS /
    RESIDUAL_SUMS / TOPK_SUMS columns (a database made before them, opened read-only)."""
    keys = list(keys)
    on = lambda a, b: " AND ".join(f"{a}.{k} = {b}.{k}" for k in keys)
    cols = token_sql(keys) + ",\n" + check_sql(checks) + ",\n" + residual_sql(residual) + ",\n" + topk_sql(topk)
    without = ((() if checks else S.CHECK_SUM_NAMES) + (() if residual else S.RESIDUAL_SUM_NAMES)
               + (() if topk else S.TOPK_SUM_NAMES))
    seq = ", ".join(f"q.{c}" for c in SEQUENCE_COLUMNS)
    flip = ("""CASE WHEN m.n_routed > 0 THEN m.n_any_flip::DOUBLE / m.n_routed END AS token_any_flip_rate,
               CASE WHEN m.n_routed > 0 THEN m.sum_flipped_layers::DOUBLE / m.n_routed END AS flipped_layers_per_token"""
            if flips else "")
    return f"""
    WITH m AS ({merged('summary_step', keys, where, without=without)} HAVING sum(n_tokens) > 0),
         h AS ({threshold_sql('summary_hist', keys, where, 'bin')}),
         q AS ({sequence_sql(keys, where)}),
         f AS ({first_position_sql(keys, where)}),
         t AS (SELECT {cols}, {seq}{', ' + flip if flip else ''}
               FROM m JOIN h ON {on('m', 'h')} JOIN q ON {on('m', 'q')} LEFT JOIN f ON {on('m', 'f')})
    SELECT {', '.join(keys)}, {', '.join(TOKEN_COLUMNS + CHECK_COLUMNS + RESIDUAL_COLUMNS + TOPK_COLUMNS)}{', ' + ', '.join(FLIP_COLUMNS) if flips else ''}
    FROM t ORDER BY {', '.join(keys)}"""


# -- routing --------------------------------------------------------------------------------------------

# load_max_vio per side: (max − mean) / mean of token counts over the experts seen on that side (count > 0)
# at this (step, layer); NULL when that side has no rows. expert_load holds one row per file and expert.
LAYER_LOAD_SQL = """
    SELECT run, step, layer,
           (max(ns) FILTER (WHERE ns > 0) - avg(ns) FILTER (WHERE ns > 0)) / avg(ns) FILTER (WHERE ns > 0)
               AS load_max_vio_sampler,
           (max(nt) FILTER (WHERE nt > 0) - avg(nt) FILTER (WHERE nt > 0)) / avg(nt) FILTER (WHERE nt > 0)
               AS load_max_vio_trainer
    FROM (SELECT run, step, layer, expert, sum(n_sampler) AS ns, sum(n_trainer) AS nt
          FROM expert_load WHERE {where} GROUP BY run, step, layer, expert)
    GROUP BY run, step, layer"""


def layer_counts_sql(where: str, weights: bool = True, margins: bool = False) -> str:
    """Per (run, step, layer): merged routing counts, the overlap numerator Σ|E_s ∩ E_t|/k, the weight sums (null
    without weights; weights=False: the database has no such columns, opened read-only), and load_max_vio; the
    margin sums (MARGIN_SUMS) too with margins=True."""
    w = (", ".join(f"{S.merge_sql('summary_layer', c)} AS {c}" for c in S.WEIGHT_SUM_NAMES) if weights else
         ", ".join(f"NULL::{c.sql_type} AS {c.name}" for c in S.WEIGHT_SUMS))
    if margins:
        w += ", " + ", ".join(f"{S.merge_sql('summary_layer', c)} AS {c}" for c in S.MARGIN_SUM_NAMES)
    return f"""
    WITH c AS (SELECT run, step, layer, min(k) AS k, sum(n_rows)::BIGINT AS n_rows, sum(n_both)::BIGINT AS n_both,
                      sum(n_flip)::BIGINT AS n_flip, sum(n_top1)::BIGINT AS n_top1,
                      sum(sum_common)::BIGINT AS sum_common, sum(n_first_flip)::BIGINT AS n_first_flip, {w}
               FROM summary_layer WHERE {where} GROUP BY run, step, layer),
         l AS ({LAYER_LOAD_SQL.format(where=where)})
    SELECT c.*, c.sum_common::DOUBLE / c.k AS sum_overlap, l.load_max_vio_sampler, l.load_max_vio_trainer
    FROM c LEFT JOIN l USING (run, step, layer)"""


def routing_by_layer_sql(where: str, weights: bool = True, margins: bool = True) -> str:
    """by=layer: [run, step, layer, n_tokens, flip_rate, top1_flip_rate, overlap, load_max_vio_*,
    weight_abs_diff_mean, weight_abs_diff_max, margin_mean_sampler, margin_mean_trainer]; flip columns over rows
    with both sides (null for sampler-only layers, n_tokens 0); the weight columns over rows with both sides'
    weights and equal expert sets (null without any); the margin means over the rows with that side's margin
    (margins=False: the database has no margin sums, opened read-only: null)."""
    return f"""
    SELECT run, step, layer, n_both AS n_tokens,
           n_flip::DOUBLE / nullif(n_both, 0) AS flip_rate,
           n_top1::DOUBLE / nullif(n_both, 0) AS top1_flip_rate,
           sum_overlap / nullif(n_both, 0) AS overlap,
           load_max_vio_sampler, load_max_vio_trainer,
           sum_weight_abs_diff / nullif(n_weight_rows, 0) AS weight_abs_diff_mean,
           CASE WHEN n_weight_rows > 0 THEN max_weight_abs_diff END AS weight_abs_diff_max,
           {margin_mean_sql(margins)}
    FROM ({layer_counts_sql(where, weights, margins)}) ORDER BY run, step, layer"""


def routing_pooled_sql(keys: Sequence[str], where: str, token_flips: bool) -> str:
    """by=step / run: rates pooled over every (token, layer) row with both sides (n_rows of them),
    load_max_vio_* the mean of the per-(step, layer) values; with token_flips, n_tokens (tokens with trainer
    routing), token_any_flip_rate and flipped_layers_per_token from the per-token flip sums."""
    k = ", ".join(keys)
    pooled = f"""SELECT {k}, sum(n_both)::BIGINT AS n_rows,
           sum(n_flip)::DOUBLE / nullif(sum(n_both), 0) AS flip_rate,
           sum(n_top1)::DOUBLE / nullif(sum(n_both), 0) AS top1_flip_rate,
           fsum(sum_overlap) / nullif(sum(n_both), 0) AS overlap,
           avg(load_max_vio_sampler) AS load_max_vio_sampler,
           avg(load_max_vio_trainer) AS load_max_vio_trainer
        FROM ({layer_counts_sql(where, weights=False)}) GROUP BY {k}"""
    if not token_flips:
        return f"""SELECT {k}, flip_rate, top1_flip_rate, overlap, load_max_vio_sampler, load_max_vio_trainer, n_rows
                   FROM ({pooled}) ORDER BY {k}"""
    on = " AND ".join(f"g.{c} = tf.{c}" for c in keys)
    return f"""
    WITH g AS ({pooled}), tf AS ({token_flip_sql(keys, where)})
    SELECT {', '.join('g.' + c for c in keys)}, coalesce(tf.n_tokens, 0) AS n_tokens,
           g.flip_rate, g.top1_flip_rate, g.overlap, g.load_max_vio_sampler, g.load_max_vio_trainer,
           tf.token_any_flip_rate, tf.flipped_layers_per_token, g.n_rows
    FROM g LEFT JOIN tf ON {on} ORDER BY {', '.join('g.' + c for c in keys)}"""


def token_flip_sql(keys: Sequence[str], where: str) -> str:
    """[keys, n_tokens, token_any_flip_rate, flipped_layers_per_token] over tokens with trainer routing;
    groups without any give no row."""
    k = ", ".join(keys)
    return f"""SELECT {k}, sum(n_routed)::BIGINT AS n_tokens,
           sum(n_any_flip)::DOUBLE / sum(n_routed) AS token_any_flip_rate,
           sum(sum_flipped_layers)::DOUBLE / sum(n_routed) AS flipped_layers_per_token
        FROM summary_step WHERE {where} GROUP BY {k} HAVING sum(n_routed) > 0 ORDER BY {k}"""


def first_flip_sql(where: str) -> str:
    """[run, first_flip_layer, n_tokens, frac]: tokens by their lowest flipped layer; fracs of a run sum to 1."""
    return f"""SELECT run, layer AS first_flip_layer, n AS n_tokens, n::DOUBLE / sum(n) OVER (PARTITION BY run) AS frac
        FROM (SELECT run, layer, sum(n_first_flip)::BIGINT AS n FROM summary_layer WHERE {where}
              GROUP BY run, layer HAVING sum(n_first_flip) > 0)
        ORDER BY run, first_flip_layer"""


def flip_mismatch_sql(where: str) -> str:
    """[run, flipped, n_tokens, log_ratio_abs_mean, kl_k3] for routed tokens with / without a flip."""
    return f"""
    WITH m AS (SELECT run, sum(n_routed)::BIGINT AS n, sum(n_any_flip)::BIGINT AS nf,
                      fsum(sum_abs_d_flip) AS af, fsum(sum_k3_flip) AS kf,
                      fsum(sum_abs_d_noflip) AS an, fsum(sum_k3_noflip) AS kn
               FROM summary_step WHERE {where} GROUP BY run HAVING sum(n_routed) > 0)
    SELECT * FROM (
        SELECT run, false AS flipped, n - nf AS n_tokens, an / (n - nf) AS log_ratio_abs_mean, kn / (n - nf) AS kl_k3
        FROM m WHERE n > nf
        UNION ALL
        SELECT run, true, nf, af / nf, kf / nf FROM m WHERE nf > 0)
    ORDER BY run, flipped"""


def layer_profile_sql(where: str) -> str:
    """[run, layer, n_tokens, flip_rate, top1_flip_rate, overlap] pooled over steps; layers without trainer
    routing give no row."""
    return f"""
    SELECT run, layer, sum(n_both)::BIGINT AS n_tokens, sum(n_flip)::DOUBLE / sum(n_both) AS flip_rate,
           sum(n_top1)::DOUBLE / sum(n_both) AS top1_flip_rate, fsum(sum_overlap) / sum(n_both) AS overlap
    FROM ({layer_counts_sql(where, weights=False)}) GROUP BY run, layer HAVING sum(n_both) > 0 ORDER BY run, layer"""


# -- buckets --------------------------------------------------------------------------------------------

def bucket_table_sql(dim: str, where: str, length_bucket: str, sequence_buckets: str | None = None) -> str:
    """The token columns per (run, bucket) of one bucket dimension: from summary_bucket, or for "length" from
    the sequence rows (a token's length bucket is its sequence's). Cap/clip columns from the ratio bands of
    summary_bucket_band / summary_seq_band (parameters: `threshold_params` on BAND_EDGES, and $dim). Sequence
    columns only for "length" (a bucket of another property splits sequences: those need the token rows).
    sequence_buckets: a relation (run, step, sample, bucket) of one bucket per sequence (a property of the whole
    sequence, such as its tag), grouped from the sequence rows like "length"; sequences without one are left out."""
    keys = ["run", "bucket"]
    on = lambda a, b: " AND ".join(f"{a}.{k} = {b}.{k}" for k in keys)
    if dim == "length" or sequence_buckets is not None:
        # each sequence's bucket: its length bucket from its rows of every file, or the given one
        lengths = sequence_buckets or f"SELECT run, step, sample, {length_bucket} AS bucket FROM ({sequences_sql(where)}) l_"
        src = (f"SELECT q.*, l.bucket FROM summary_seq q JOIN ({lengths}) l USING (run, step, sample) "
               "WHERE q.n_tokens > 0")
        band_src = f"SELECT q.*, l.bucket FROM summary_seq_band q JOIN ({lengths}) l USING (run, step, sample)"
        seq = f"q AS ({sequence_sql(keys, where, length_bucket, buckets=sequence_buckets)})"
        seq_cols = ", ".join(f"q.{c}" for c in SEQUENCE_COLUMNS)
        seq_join = f"JOIN q ON {on('m', 'q')}"
        table = "summary_seq"
    else:
        src = "SELECT * FROM summary_bucket WHERE dim = $dim"
        band_src = "SELECT * FROM summary_bucket_band WHERE dim = $dim"
        seq, seq_cols, seq_join = "", ", ".join(f"NULL AS {c}" for c in SEQUENCE_COLUMNS), ""
        table = "summary_bucket"
    m = merged(table, keys, where, source=src)
    h = threshold_sql(f"({band_src}) b_", keys, where, "band")
    return f"""
    WITH m AS ({m} HAVING sum(n_tokens) > 0), h AS ({h}){', ' + seq if seq else ''}
    SELECT {', '.join(keys)}, {', '.join(TOKEN_COLUMNS)} FROM (
        SELECT {token_sql(keys)}, {seq_cols} FROM m JOIN h ON {on('m', 'h')} {seq_join}) t_
    ORDER BY {', '.join(keys)}"""
