"""The counts of the residual signatures (schema.RESIDUAL_SUMS, METRICS.md v3) over token rows: one numba pass
for DriftLogger's CPU steps (grid_counts) and the ingest stream (ResidualSums, summary_stream.py), SQL for
ingest's fallback over stored rows (residual_sums_sql, ingest/summarise.py); an accelerator's steps take torch
(analysis/record/residual.py). All compare the same float64 Δ = t − s with the same constants (round half to
even or away from zero cannot matter: a value half-way between multiples is 0.5 away either way), so their
counts agree exactly.

A segment's first token is the one of least pos among a sequence's tokens with that segment id. The stream sees a
sequence's tokens in several batches, so it keeps, per batch, one candidate per (sequence, segment) (its least pos
and whether Δ is low there) and settles the firsts when the step ends.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from analysis.summaries import schema as S


@njit(cache=True, nogil=True, error_model="numpy")
def _counts(s, t, mask, seg, T, out):
    """One pass over a [B, T] grid (flat, C order): out[:] = the RESIDUAL_SUMS counts of the tokens with mask;
    seg: their segment ids (>= 0 where masked in), or an empty array for none. Positions are visited in order
    within a row, so the first token of a segment met in the row is its least position."""
    has_seg = seg.size > 0
    n_ids = 1
    if has_seg:  # the largest id of a trained token (padding may hold any)
        for i in range(mask.size):
            if mask[i] and seg[i] >= n_ids:
                n_ids = seg[i] + 1
    seen = np.full(n_ids, -1, np.int64)  # the last row each segment id was met in
    n = nonzero = lattice = n_seg = first = first_low = low_all = 0
    q, tol, low = S.LATTICE_Q, S.LATTICE_TOL, S.BOUNDARY_LOW
    for row in range(mask.size // T):
        for i in range(row * T, (row + 1) * T):
            if not mask[i]:
                continue
            d = t[i] - s[i]
            n += 1
            if d != 0.0:
                nonzero += 1
                x = d / q
                if abs(x - np.rint(x)) < tol:
                    lattice += 1
            if has_seg:
                g = seg[i]
                n_seg += 1
                if d < low:
                    low_all += 1
                if seen[g] != row:
                    seen[g] = row
                    first += 1
                    if d < low:
                        first_low += 1
    out[0], out[1], out[2], out[3] = n, nonzero, lattice, n_seg
    out[4], out[5], out[6] = first, first_low, low_all - first_low


@njit(cache=True, nogil=True, error_model="numpy")
def _lattice_counts(d, out):
    """out[0] = #{Δ ≠ 0}, out[1] = of those, #{on the lattice of LATTICE_Q} (as in _counts)."""
    q, tol = S.LATTICE_Q, S.LATTICE_TOL
    for i in range(d.size):
        if d[i] != 0.0:
            out[0] += 1
            x = d[i] / q
            if abs(x - np.rint(x)) < tol:
                out[1] += 1


def grid_counts(s: np.ndarray, t: np.ndarray, mask: np.ndarray, segments: np.ndarray | None) -> dict[str, int]:
    """RESIDUAL_SUMS of a step's [B, T] float64 log-probs, bool mask and int64 segment ids (or None), numpy in C
    order (DriftLogger's CPU tensors, no copy); padding may hold anything. One numba pass (~1–2 ns a token)."""
    out = np.zeros(7, np.int64)
    T = s.shape[1] if s.ndim == 2 else 1
    seg = np.zeros(0, np.int64) if segments is None else np.ascontiguousarray(segments, np.int64).reshape(-1)
    _counts(np.ascontiguousarray(s, np.float64).reshape(-1), np.ascontiguousarray(t, np.float64).reshape(-1),
            np.ascontiguousarray(mask, np.bool_).reshape(-1), seg, T, out)
    return dict(zip(S.RESIDUAL_SUM_NAMES, (int(v) for v in out)))


class ResidualSums:
    """RESIDUAL_SUMS of one (run, step), token batch by token batch."""

    def __init__(self):
        self.n = self.nonzero = self.lattice = self.seg = self.seg_low = 0
        self.firsts: list[np.ndarray] = []  # [4, m] per batch: sequence, segment, pos, low of the candidates

    def add(self, d: np.ndarray, seq: np.ndarray, pos: np.ndarray, segment: np.ndarray | None) -> None:
        """Tokens' Δ, dense sequence index, pos and segment (None: no segment column; −1 where null)."""
        self.n += len(d)
        out = np.zeros(2, np.int64)
        _lattice_counts(np.ascontiguousarray(d, np.float64), out)
        self.nonzero += int(out[0])
        self.lattice += int(out[1])
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
