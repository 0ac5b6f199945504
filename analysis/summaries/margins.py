"""Router margins (METRICS.md v3 "Routing margins and weights"): their bins, and the columns read from the sums.

A (token, layer) row's margin is the k-th largest minus the (k+1)-th largest router probability (softmax of the
router logits in fp32) on one side: near 0 the router is undecided between its k-th and (k+1)-th expert, and the
smallest numeric difference between sampler and trainer may swap them (a flip). Margins are stored as fp32; the
sums and the bins read that fp32 value (widened exactly), so DriftLogger, ingest's SQL and a reference agree.

Bins on schema.MARGIN_EDGES E = (0, 1e-4, 1e-3, 1e-2, 1e-1, 1): bin b holds [E[b], E[b+1]) for b < 4 and bin 4
the closed [0.1, 1], i.e. b = #{interior edges <= m}. The per-bin sums (summary_margin) count only rows with both
sides' experts (a flip needs both); flip_rate_by_margin bins by the sampler's margin where the run has any, else
by the trainer's (RouterCapture records the trainer's side), and says which in `side`.
"""
from __future__ import annotations

import numpy as np

from analysis.summaries import schema as S

N_MARGIN_BINS = len(S.MARGIN_EDGES) - 1
_INTERIOR = S.MARGIN_EDGES[1:-1]
MARGIN_COLUMNS = ("margin_mean_sampler", "margin_mean_trainer")  # by=layer, from summary_layer's MARGIN_SUMS
BY_MARGIN_COLUMNS = ("run", "side", "margin_bin", "margin_lo", "margin_hi", "n_tokens", "flip_rate",
                     "log_ratio_abs_mean")


def margin_bin(m: np.ndarray) -> np.ndarray:
    """The bin of each margin (values in [0, 1]) on schema.MARGIN_EDGES, as int64.

    >>> margin_bin(np.array([0.0, 5e-5, 1e-4, 0.05, 0.1, 1.0])).tolist()
    [0, 0, 1, 3, 4, 4]
    """
    return np.searchsorted(np.asarray(_INTERIOR), m, side="right").astype(np.int64)


def margin_bin_sql(col: str) -> str:
    """SQL of `margin_bin` for a margin column (widened to DOUBLE: the stored FLOAT compared with float64 edges)."""
    return "(" + " + ".join(f"({col}::DOUBLE >= {e!r})::SMALLINT" for e in _INTERIOR) + ")::SMALLINT"


def margin_label(b: int) -> str:
    lo, hi = S.MARGIN_EDGES[b], S.MARGIN_EDGES[b + 1]
    return f"[{lo:g}, {hi:g}]" if b == N_MARGIN_BINS - 1 else f"[{lo:g}, {hi:g})"


def margin_mean_sql(margins: bool = True) -> str:
    """Select-list of MARGIN_COLUMNS over merged MARGIN_SUMS (columns of the same names); null where a layer has
    no margin of that side; margins=False: the database has no such columns (opened read-only)."""
    if not margins:
        return ", ".join(f"NULL::DOUBLE AS {c}" for c in MARGIN_COLUMNS)
    return ", ".join(f"sum_margin_{side} / nullif(n_margin_{side}, 0) AS margin_mean_{side}"
                     for side in S.MARGIN_SIDES)


def by_margin_sql(where: str) -> str:
    """flip_rate_by_margin per (run, margin bin) over the summary_margin rows matching `where`: each run's rows of
    the sampler's margin where it has any, else the trainer's. Returns [run, side, margin_bin, n_tokens,
    flip_rate, log_ratio_abs_mean] (flip_rate = Σ n_flip / Σ n_rows, log_ratio_abs_mean = Σ |Δ| / Σ n_rows)."""
    return f"""
    WITH g AS (SELECT run, side, margin_bin, sum(n_rows)::BIGINT AS n_tokens, sum(n_flip)::BIGINT AS n_flip,
                      fsum(sum_abs_d) AS sum_abs_d
               FROM summary_margin WHERE {where} GROUP BY run, side, margin_bin HAVING sum(n_rows) > 0),
         pick AS (SELECT run, min(side) AS side FROM g GROUP BY run)
    SELECT g.run, g.side, g.margin_bin::BIGINT AS margin_bin, g.n_tokens,
           g.n_flip::DOUBLE / g.n_tokens AS flip_rate, g.sum_abs_d / g.n_tokens AS log_ratio_abs_mean
    FROM g JOIN pick USING (run, side) ORDER BY g.run, g.margin_bin"""
