"""The counts of the residual signatures (schema.RESIDUAL_SUMS, METRICS.md v3) over token rows: numpy for the
ingest stream (summary_stream.py), SQL for ingest's fallback over stored rows (ingest/summarise.py). The trainer's
torch twin is analysis/record/residual.py; all three compare the same float64 Δ = t − s with the same constants,
so their counts agree exactly.

A segment's first token is the one of least pos among a sequence's tokens with that segment id. The stream sees a
sequence's tokens in several batches, so it keeps, per batch, one candidate per (sequence, segment) (its least pos
and whether Δ is low there) and settles the firsts when the step ends.
"""
from __future__ import annotations

import numpy as np

from analysis.summaries import schema as S


def on_lattice(d: np.ndarray, q: float = S.LATTICE_Q) -> np.ndarray:
    """Whether each Δ is nonzero and within LATTICE_TOL of a multiple of q (round: half to even, which cannot
    matter: a value half-way is 0.5 away either way)."""
    x = d / q
    return (d != 0) & (np.abs(x - np.round(x)) < S.LATTICE_TOL)


class ResidualSums:
    """RESIDUAL_SUMS of one (run, step), token batch by token batch."""

    def __init__(self):
        self.n = self.nonzero = self.lattice = self.seg = self.seg_low = 0
        self.firsts: list[np.ndarray] = []  # [4, m] per batch: sequence, segment, pos, low of the candidates

    def add(self, d: np.ndarray, seq: np.ndarray, pos: np.ndarray, segment: np.ndarray | None) -> None:
        """Tokens' Δ, dense sequence index, pos and segment (None: no segment column; −1 where null)."""
        self.n += len(d)
        self.nonzero += int(np.count_nonzero(d))
        self.lattice += int(np.count_nonzero(on_lattice(d)))
        if segment is None:
            return
        has = segment >= 0
        if not has.all():
            d, seq, pos, segment = d[has], seq[has], pos[has], segment[has]
        if not len(d):
            return
        low = d < S.BOUNDARY_LOW
        self.seg += len(d)
        self.seg_low += int(np.count_nonzero(low))
        self.firsts.append(_firsts(np.stack([seq, segment, pos, low.astype(np.int64)])))

    def row(self) -> dict[str, int]:
        first = first_low = 0
        if self.firsts:
            best = _firsts(np.concatenate(self.firsts, axis=1))
            first, first_low = best.shape[1], int(best[3].sum())
        return {"n_res_tokens": self.n, "n_d_nonzero": self.nonzero, "n_lattice": self.lattice,
                "n_seg_tokens": self.seg, "n_seg_first": first, "n_seg_first_low": first_low,
                "n_seg_rest_low": self.seg_low - first_low}


def _firsts(rows: np.ndarray) -> np.ndarray:
    """Of [sequence, segment, pos, low] columns, the one of least pos per (sequence, segment)."""
    order = np.lexsort((rows[2], rows[1], rows[0]))
    rows = rows[:, order]
    new = np.ones(rows.shape[1], bool)
    new[1:] = (rows[0, 1:] != rows[0, :-1]) | (rows[1, 1:] != rows[1, :-1])
    return rows[:, new]


def residual_sums_sql(src: str) -> str:
    """SELECT run, step and RESIDUAL_SUMS over `src` (columns run, step, sample, pos, s, t, segment), per (run,
    step). Parameters: none (the constants are written in: they are the schema's, not the user's)."""
    q, tol, low = float(S.LATTICE_Q), float(S.LATTICE_TOL), float(S.BOUNDARY_LOW)
    return f"""SELECT run, step, count(*)::BIGINT AS n_res_tokens, count_if(d <> 0)::BIGINT AS n_d_nonzero,
                      count_if(d <> 0 AND abs(d / {q!r} - round(d / {q!r})) < {tol!r})::BIGINT AS n_lattice,
                      count(segment)::BIGINT AS n_seg_tokens,
                      count_if(segment IS NOT NULL AND pos = first_pos)::BIGINT AS n_seg_first,
                      count_if(segment IS NOT NULL AND pos = first_pos AND d < {low!r})::BIGINT AS n_seg_first_low,
                      count_if(segment IS NOT NULL AND pos > first_pos AND d < {low!r})::BIGINT AS n_seg_rest_low
               FROM (SELECT run, step, pos, segment, t - s AS d,
                            min(pos) OVER (PARTITION BY run, step, sample, segment) AS first_pos
                     FROM ({src}) rs_) rw_
               GROUP BY run, step"""
