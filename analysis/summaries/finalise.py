"""METRICS.md columns from summary rows: the one place where the formulas meet the summaries.

Every function merges the partial rows of the selected (run, step) range by SUM / MIN / MAX over the wanted
group (a step, a run, a layer, a bucket), then applies the definitions. The sums were taken in forms that do
not cancel (schema.py): r − 1 rather than r, 1 − p rather than p, k3 by its series near 0.
"""
from __future__ import annotations

import math
from typing import Sequence

from analysis.summaries import schema as S

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


def summarised(cap: float, clip: float) -> bool:
    """Whether C and ε are among the values the summaries answer exactly (schema.CAPS, schema.CLIPS)."""
    return float(cap) in S.CAPS and float(clip) in S.CLIPS


def _edge_bin(x: float, edges: Sequence[float]) -> int:
    """The odd bin id of the edge x (schema bin convention): 2·index + 1."""
    return 2 * list(edges).index(x) + 1


def merged(table: str, keys: Sequence[str], where: str, only: Sequence[str] | None = None) -> str:
    """SELECT keys, merged columns FROM table WHERE where GROUP BY keys (sums add, minima and maxima merge)."""
    outs = []
    for c in S.columns(table):
        kind = S.merge_kind(c)
        if kind == "key" or (only is not None and c not in only):
            continue
        if kind == "sum":
            outs.append(f"fsum({c}) AS {c}" if _is_double(table, c) else f"sum({c})::BIGINT AS {c}")
        else:
            outs.append(f"{kind}({c}) AS {c}")
    return f"SELECT {', '.join(keys)}, {', '.join(outs)} FROM {table} WHERE {where} GROUP BY {', '.join(keys)}"


def _is_double(table: str, col: str) -> bool:
    return next(c for c in S.TABLES[table] if c.name == col).sql_type == "DOUBLE"


def token_sql(keys: Sequence[str]) -> str:
    """Select-list of the token columns over a merged relation with TOKEN_SUMS (aliased m) and the cap/clip
    counts of `threshold_sql` (aliased h): everything but the sequence columns."""
    n = "m.n_tokens::DOUBLE"
    c = float(S.CLAMP)
    r_of = lambda d: f"exp(CASE WHEN {d} < -{c} THEN -{c} WHEN {d} > {c} THEN {c} ELSE {d} END)"
    w_of = lambda d: f"(CASE WHEN {r_of(d)} < 1.0 / $cap THEN 1.0 / $cap WHEN {r_of(d)} > $cap THEN $cap ELSE {r_of(d)} END)"
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
        # corr(exp t, exp s) = corr(1 − exp t, 1 − exp s); null when either column is constant
        f"""CASE WHEN exp(m.min_s) = exp(m.max_s) OR exp(m.min_t) = exp(m.max_t) OR {vx} <= 0 OR {vy} <= 0
                 THEN NULL ELSE {cov} / sqrt({vx} * {vy}) END AS prob_pearson""",
        f"1.0 + m.sum_rm1 / {n} AS ratio_mean",
        f"CASE WHEN {r_of('m.min_d')} = {r_of('m.max_d')} THEN 0.0 ELSE sqrt(greatest({var_r}, 0.0)) END AS ratio_std",
        f"{r_of('m.min_d')} AS ratio_min",
        f"{r_of('m.max_d')} AS ratio_max",
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
    return {"cap": cap, "hi_bin": _edge_bin(math.log(cap), edges), "lo_bin": _edge_bin(-math.log(cap), edges),
            "clip_hi_bin": _edge_bin(math.log1p(clip), edges), "clip_lo_bin": _edge_bin(math.log1p(-clip), edges)}


def sequence_sql(keys: Sequence[str], where: str) -> str:
    """Per group of `keys` (a subset of run, step, plus any column of summary_seq): the sequence columns
    over whole sequences (a sequence's rows from every file and band merged first)."""
    c = float(S.CLAMP)
    cs = f"(CASE WHEN sum_d < -{c} THEN -{c} WHEN sum_d > {c} THEN {c} ELSE sum_d END)"
    u = f"exp(2.0 * {cs})"
    expm1_2cs = f"(CASE WHEN {u} = 1.0 THEN 2.0 * {cs} ELSE ({u} - 1.0) * 2.0 * {cs} / ln({u}) END)"
    return f"""SELECT {', '.join(keys)}, count(*) AS n_sequences,
               avg(exp(-sum_d / n)) AS ppl_ratio,
               avg({expm1_2cs}) AS chi2_seq,
               max(abs(sum_d)) AS seq_log_ratio_abs_max,
               avg(exp(sum_d / n)) AS seq_geo_ratio_mean,
               min(exp(sum_d / n)) AS seq_geo_ratio_min,
               max(exp(sum_d / n)) AS seq_geo_ratio_max
        FROM (SELECT run, step, sample, sum(n_tokens)::DOUBLE AS n, fsum(sum_d) AS sum_d
              FROM summary_seq WHERE {where} GROUP BY run, step, sample HAVING sum(n_tokens) > 0)
        GROUP BY {', '.join(keys)}"""


def token_table_sql(keys: Sequence[str], where: str, flips: bool = True) -> str:
    """The METRICS.md token table (TOKEN_COLUMNS, plus FLIP_COLUMNS with flips=True) per group of `keys`
    (("run",) or ("run", "step")) over the summary rows matching `where`. Parameters: `threshold_params`."""
    keys = list(keys)
    on = lambda a, b: " AND ".join(f"{a}.{k} = {b}.{k}" for k in keys)
    cols = token_sql(keys)
    seq = ", ".join(f"q.{c}" for c in SEQUENCE_COLUMNS)
    flip = ("""CASE WHEN m.n_routed > 0 THEN m.n_any_flip::DOUBLE / m.n_routed END AS token_any_flip_rate,
               CASE WHEN m.n_routed > 0 THEN m.sum_flipped_layers::DOUBLE / m.n_routed END AS flipped_layers_per_token"""
            if flips else "")
    return f"""
    WITH m AS ({merged('summary_step', keys, where)} HAVING sum(n_tokens) > 0),
         h AS ({threshold_sql('summary_hist', keys, where, 'bin')}),
         q AS ({sequence_sql(keys, where)}),
         t AS (SELECT {cols}, {seq}{', ' + flip if flip else ''}
               FROM m JOIN h ON {on('m', 'h')} JOIN q ON {on('m', 'q')})
    SELECT {', '.join(keys)}, {', '.join(TOKEN_COLUMNS)}{', ' + ', '.join(FLIP_COLUMNS) if flips else ''}
    FROM t ORDER BY {', '.join(keys)}"""
