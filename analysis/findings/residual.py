"""What is left of a mismatch has signatures practitioners name one by one
(docs/DIAGNOSIS.md#2026-h2-new-evidence-and-open-questions); three of them need nothing but one run's numbers:

- first_token: the share of Σ k3 at response position 0 (METRICS.md v3 `first_token_kl_share`): a mismatch
  concentrated on the first generated token (prefill against decode, a chat template's first token);
- lattice: Δ on multiples of a quantum q = 2^-k (default 0.125, an FP8 step): the share of tokens with Δ ≠ 0
  that sit on a NON-ZERO multiple of q within 1e-6. The summaries' `lattice_share_q` counts every multiple,
  0·q included, i.e. every 0 < |Δ| < q·1e-6 = 1.25e-7: all of an fp32 control's tokens would count;
- retokenization: Δ < −10 at a segment's (turn's) first token against elsewhere (`boundary_low_share`,
  `elsewhere_low_share`).

Each is read from the summaries where they hold it: Σ k3 by position bucket always; the residual counts
(RESIDUAL_SUMS) where they cover every token of the run (rows written before them hold nulls: token rows then).
The lattice share leaves out the zero multiples with the fine Δ bins of summary_hist: a bin wholly inside
0 < |Δ| < q·1e-6 holds only zero multiples, a bin that straddles that edge some, and only bins reaching |Δ| >
q(1 − 1e-6) can hold a non-zero multiple. When these bounds leave the count open (a token near 1.25e-7 and one
on the lattice at once), or q is not schema.LATTICE_Q, the share comes from the token rows. Token rows may be a
sample of the run's tokens (DriftLogger's token_sample): a share read there is an estimate from that sample.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl

from analysis.findings.gates import _bin_bounds, delta_bin_counts
from analysis.store import Store
from analysis.summaries import schema as S
from analysis.summaries.sql import run_filter, token_terms_sql

LATTICE_Q = S.LATTICE_Q
LATTICE_TOL = S.LATTICE_TOL
BOUNDARY_LOW = S.BOUNDARY_LOW

COLUMNS = {"run": pl.String, "n_tokens": pl.Int64, "kl_k3": pl.Float64, "first_token_kl_share": pl.Float64,
           "k3_first": pl.Float64, "k3_rest": pl.Float64, "n_first": pl.Int64, "n_nonzero": pl.Int64,
           "lattice_share": pl.Float64, "q": pl.Float64, "lattice_from": pl.String, "n_seg_first": pl.Int64,
           "n_seg_first_low": pl.Int64, "n_seg_rest": pl.Int64, "n_seg_rest_low": pl.Int64,
           "boundary_low_share": pl.Float64, "elsewhere_low_share": pl.Float64, "segments_from": pl.String}


def signature_table(store: Store, runs: Sequence[str], q: float = LATTICE_Q,
                    steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Per run (COLUMNS): n_tokens, kl_k3, first_token_kl_share (NULL when Σ k3 is 0), k3 mean at position 0
    (k3_first) and elsewhere (k3_rest), n_first; n_nonzero (tokens with Δ ≠ 0), lattice_share (of those, on a
    non-zero multiple of q), q, lattice_from ('summaries', 'summaries and token rows' or 'token rows'); the
    segment counts n_seg_first(_low), n_seg_rest(_low), boundary_low_share, elsewhere_low_share (null without
    segments) and segments_from."""
    if not q > 0:
        raise ValueError(f"lattice quantum q: expected a number > 0, got {q!r}")
    runs = list(runs)
    summ = summary_signatures(store, runs, steps)
    rows = {r["run"]: r for r in summ.iter_rows(named=True)}
    lattice = _summary_lattice(store, summ, steps) if float(q) == LATTICE_Q else {}
    need_lattice = [r for r in rows if lattice.get(r, (None,))[0] is None]
    need_segments = [r for r, v in rows.items() if not v["covered"]]
    need = sorted(set(need_lattice) | set(need_segments))
    tok = {r["run"]: r for r in token_signatures(store, need, q, steps).iter_rows(named=True)} if need else {}
    out = []
    for run, v in rows.items():
        row = {k: v.get(k) for k in COLUMNS}
        row["q"] = float(q)
        if lattice.get(run, (None,))[0] is not None:
            row["n_nonzero"], (row["lattice_share"], row["lattice_from"]) = v["n_nonzero"], lattice[run]
        else:
            t = tok.get(run) or {}
            row["n_nonzero"], row["lattice_share"], row["lattice_from"] = (t.get("n_nonzero"), t.get("lattice_share"),
                                                                           "token rows")
        if v["covered"]:
            row["segments_from"] = "summaries"
        else:
            t = tok.get(run) or {}
            row.update({k: t.get(k) for k in ("n_seg_first", "n_seg_first_low", "n_seg_rest", "n_seg_rest_low")},
                       segments_from="token rows")
        nf, nr = row["n_seg_first"] or 0, row["n_seg_rest"] or 0
        row["boundary_low_share"] = row["n_seg_first_low"] / nf if nf else None
        row["elsewhere_low_share"] = row["n_seg_rest_low"] / nr if nr else None
        out.append(row)
    return pl.DataFrame(out, schema=COLUMNS, orient="row") if out else pl.DataFrame(schema=COLUMNS)


def summary_signatures(store: Store, runs: Sequence[str], steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Per run from the summaries: n_tokens, kl_k3, first_token_kl_share, k3_first, k3_rest, n_first; and where
    RESIDUAL_SUMS cover every token (covered): n_nonzero, n_lattice (every multiple of LATTICE_Q, 0·q included)
    and the segment counts."""
    where, params = run_filter(list(runs), steps)
    has = store.has_residual_sums
    res = (lambda c: f"sum({c})::BIGINT") if has else (lambda c: "NULL::BIGINT")
    covered = f"coalesce({res('n_res_tokens')}, 0) = sum(n_tokens)"
    return store.sql(f"""
        WITH m AS (SELECT run, sum(n_tokens)::BIGINT AS n_tokens, fsum(sum_k3) AS sum_k3, {covered} AS covered,
                          {res('n_d_nonzero')} AS n_nonzero, {res('n_lattice')} AS n_lattice,
                          {res('n_seg_first')} AS n_seg_first, {res('n_seg_first_low')} AS n_seg_first_low,
                          {res('n_seg_tokens')} - {res('n_seg_first')} AS n_seg_rest,
                          {res('n_seg_rest_low')} AS n_seg_rest_low
                   FROM summary_step WHERE {where} GROUP BY run HAVING sum(n_tokens) > 0),
             f AS (SELECT run, sum(n_tokens) FILTER (WHERE bucket = 0)::BIGINT AS n_first,
                          fsum(sum_k3) FILTER (WHERE bucket = 0) AS k3_sum_first,
                          sum(n_tokens) FILTER (WHERE bucket > 0)::BIGINT AS n_rest,
                          fsum(sum_k3) FILTER (WHERE bucket > 0) AS k3_sum_rest
                   FROM summary_bucket WHERE {where} AND dim = 'position' GROUP BY run)
        SELECT m.run, m.n_tokens, m.sum_k3 / m.n_tokens AS kl_k3,
               CASE WHEN m.sum_k3 > 0 THEN coalesce(f.k3_sum_first, 0.0) / m.sum_k3 END AS first_token_kl_share,
               f.k3_sum_first / nullif(f.n_first, 0) AS k3_first, f.k3_sum_rest / nullif(f.n_rest, 0) AS k3_rest,
               coalesce(f.n_first, 0)::BIGINT AS n_first, m.covered,
               CASE WHEN m.covered THEN m.n_nonzero END AS n_nonzero,
               CASE WHEN m.covered THEN m.n_lattice END AS n_lattice,
               CASE WHEN m.covered THEN coalesce(m.n_seg_first, 0) END AS n_seg_first,
               CASE WHEN m.covered THEN coalesce(m.n_seg_first_low, 0) END AS n_seg_first_low,
               CASE WHEN m.covered THEN coalesce(m.n_seg_rest, 0) END AS n_seg_rest,
               CASE WHEN m.covered THEN coalesce(m.n_seg_rest_low, 0) END AS n_seg_rest_low
        FROM m LEFT JOIN f USING (run) ORDER BY m.run""", params)


def zero_multiple_bounds(counts: pl.DataFrame, q: float = LATTICE_Q) -> tuple[int, int, int, int]:
    """From fine Δ bin counts [bin, n] of one run: (sure, maybe, far, total): tokens in bins wholly inside
    0 < |Δ| < q·tol (the zero multiples the summaries' n_lattice counts), in bins that straddle that edge, in bins
    that reach |Δ| > q(1 − tol) (where every non-zero multiple lies), and in all bins."""
    if counts.is_empty():
        return 0, 0, 0, 0
    b, n = counts["bin"].to_numpy().astype(np.int64), counts["n"].to_numpy().astype(np.int64)
    lo, hi = _bin_bounds(b)
    point = b % 2 == 1
    z, g = q * LATTICE_TOL, q * (1.0 - LATTICE_TOL)
    # a point bin is the value lo == hi; an interval bin the open (lo, hi)
    inside = np.where(point, (lo != 0) & (np.abs(lo) < z), ((lo >= 0) & (hi <= z)) | ((lo >= -z) & (hi <= 0)))
    touches = np.where(point, inside, ((lo < z) & (hi > 0)) | ((lo < 0) & (hi > -z)))
    far = np.where(point, np.abs(lo) >= g, (hi >= g) | (lo <= -g))
    return int(n[inside].sum()), int(n[touches & ~inside].sum()), int(n[far].sum()), int(n.sum())


def lattice_from_counts(n_nonzero: int, n_lattice: int, sure: int, maybe: int, far: int) -> float | None:
    """The share of Δ ≠ 0 on a non-zero multiple, from the summaries' n_lattice (every multiple) and the bin
    bounds of zero_multiple_bounds; None where they leave it open."""
    lo = max(0, n_lattice - sure - maybe)
    hi = min(far, n_lattice - sure)
    if lo != hi or not n_nonzero:
        return None
    return lo / n_nonzero


def _summary_lattice(store: Store, summ: pl.DataFrame, steps) -> dict[str, tuple[float | None, str]]:
    """{run: (lattice_share, where from)}: from the summaries, with the zero multiples counted over the token rows
    where the summaries' Δ bins straddle their edge; (None, "") where the summaries cannot give it."""
    runs = [r["run"] for r in summ.iter_rows(named=True) if r["covered"] and r["n_nonzero"]]
    if not runs:
        return {}
    counts = delta_bin_counts(store, runs, steps)
    out = {}
    for r in summ.filter(pl.col("run").is_in(runs)).iter_rows(named=True):
        sure, maybe, far, total = zero_multiple_bounds(counts.filter(pl.col("run") == r["run"]))
        share = None if total != r["n_tokens"] else lattice_from_counts(
            r["n_nonzero"], r["n_lattice"], sure, maybe, far)
        out[r["run"]] = (share, "summaries")
    open_runs = [r["run"] for r in summ.filter(pl.col("run").is_in(runs)).iter_rows(named=True)
                 if out[r["run"]][0] is None]
    if open_runs:  # bins straddle the edge: count the zero multiples themselves (two columns, no window)
        zeros = _zero_multiples(store, open_runs, steps)
        for r in summ.filter(pl.col("run").is_in(open_runs)).iter_rows(named=True):
            if r["run"] in zeros:
                out[r["run"]] = ((r["n_lattice"] - zeros[r["run"]]) / r["n_nonzero"], "summaries and token rows")
    return out


def _zero_multiples(store: Store, runs: Sequence[str], steps) -> dict[str, int]:
    """{run: tokens with Δ ≠ 0 on the zero multiple of q (|Δ/q| < tol)}: what the summaries' n_lattice counts
    beside the non-zero multiples, from the token rows; exact where those rows are complete (the caller uses it
    only for runs whose summaries cover every token)."""
    where, params = run_filter(list(runs), steps)
    params |= {"q": LATTICE_Q, "tol": LATTICE_TOL}
    src = f"SELECT run, sampler_logprob AS s, trainer_logprob AS t FROM tokens WHERE {where}"
    df = store.sql(f"""SELECT run, count(*) FILTER (WHERE d <> 0 AND abs(d / $q - round(d / $q)) < $tol
                                                     AND round(d / $q) = 0) AS n
                       FROM (SELECT run, t - s AS d FROM ({src})) GROUP BY run""", params)
    return dict(zip(df["run"].to_list(), df["n"].to_list()))


def token_signatures(store: Store, runs: Sequence[str], q: float = LATTICE_Q,
                     steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Per run from the token rows (k3: the summaries' own per-token term, summaries/sql.py): n_tokens, kl_k3,
    first_token_kl_share, k3_first, k3_rest, n_first, n_nonzero, lattice_share (non-zero multiples of q), q, and
    the segment counts (a segment's first token: least pos among a sequence's tokens of that segment, per step)."""
    if not q > 0:
        raise ValueError(f"lattice quantum q: expected a number > 0, got {q!r}")
    where, params = run_filter(list(runs), steps)
    params["q"] = float(q)
    params["tol"] = LATTICE_TOL
    params["low"] = BOUNDARY_LOW
    seg = "segment" if store.has_columns("tokens", ["segment"]) else "NULL::INTEGER AS segment"
    src = (f"SELECT run, step, sample, pos, {seg}, sampler_logprob AS s, trainer_logprob AS t FROM tokens "
           f"WHERE {where}")
    first = "segment IS NOT NULL AND pos = first_pos"
    rest = "segment IS NOT NULL AND pos > first_pos"
    return store.sql(f"""
        WITH k AS (SELECT run, pos, segment, d, k3, round(d / $q) AS m,
                          min(pos) OVER (PARTITION BY run, step, sample, segment) AS first_pos
                   FROM ({token_terms_sql(src)}))
        SELECT run, count(*) AS n_tokens, avg(k3) AS kl_k3,
               CASE WHEN sum(k3) > 0 THEN coalesce(sum(k3) FILTER (WHERE pos = 0), 0.0) / sum(k3) END
                   AS first_token_kl_share,
               avg(k3) FILTER (WHERE pos = 0) AS k3_first, avg(k3) FILTER (WHERE pos > 0) AS k3_rest,
               count(*) FILTER (WHERE pos = 0) AS n_first,
               count(*) FILTER (WHERE d <> 0) AS n_nonzero,
               count(*) FILTER (WHERE d <> 0 AND m <> 0 AND abs(d / $q - m) < $tol)::DOUBLE
                   / nullif(count(*) FILTER (WHERE d <> 0), 0) AS lattice_share,
               $q AS q,
               count(*) FILTER (WHERE {first}) AS n_seg_first,
               count(*) FILTER (WHERE {first} AND d < $low) AS n_seg_first_low,
               count(*) FILTER (WHERE {rest}) AS n_seg_rest,
               count(*) FILTER (WHERE {rest} AND d < $low) AS n_seg_rest_low
        FROM k GROUP BY run ORDER BY run""", params)
