"""Quantiles of token |Δ| and of per-sequence Δ at any run size, from the summaries.

Sequence quantiles (|mean Δ| and |ΣΔ| over a group's sequences) read `summary_seq`: one row per sequence and file,
so they are exact and cost what the sequences cost. Token |Δ| quantiles need order statistics of the tokens
themselves; the fixed Δ histogram (`summary_hist`) says which bin holds each wanted rank, and one pass over the
token rows, filtered to those few bins, ranks only the tokens inside them (about one bin's share of the tokens
instead of all of them, and no sort of the rest). That pass still reads the selection's token rows (about 1 s per
20M tokens here), so above EXACT_TOKENS selected tokens, and where a run's token rows are a sample (DriftLogger
with `token_sample < 1`: the histogram counts every token, the rows do not), the value is interpolated
log-linearly inside its bin instead: within one bin width (10 bins per decade of |Δ|) of the true quantile.
Column `token_exact` says which way each row was computed.

Quantiles follow numpy's default ("linear"): rank h = (n − 1)·p, value x₍⌊h⌋₎ + (h − ⌊h⌋)(x₍⌊h⌋+1₎ − x₍⌊h⌋₎).
"""
from __future__ import annotations

import bisect
import math
from typing import Sequence

import polars as pl

from analysis.metrics import read
from analysis.store import Store
from analysis.summaries import finalise as F
from analysis.summaries import schema as S
from analysis.summaries.sql import run_filter, token_filter

EXACT_TOKENS = 4_000_000  # above this many selected tokens, token quantiles come from the histogram alone
Cell = tuple[float, float]  # |Δ| interval of a fine bin: (lo, hi) open, or (x, x) for the values exactly on edge x


def abs_cells() -> list[Cell]:
    """Per fine bin id of summary_hist, its interval of |Δ|. D_EDGES is symmetric around 0 and holds 0, so a
    bin and its mirror image share one interval and no bin straddles 0."""
    e = S.D_EDGES
    assert 0.0 in e and all(-x in e for x in e), "D_EDGES must be symmetric around 0 and hold 0"
    cells = []
    for b in range(S.N_BINS):
        k, on_edge = divmod(b, 2)
        if on_edge:
            cells.append((abs(e[k]), abs(e[k])))
            continue
        lo = e[k - 1] if k > 0 else -math.inf
        hi = e[k] if k < len(e) else math.inf
        cells.append((-hi, -lo) if hi <= 0 else (lo, hi))
    return cells


def _ranks(n: int, p: float) -> tuple[int, float]:
    h = (n - 1) * p
    i = math.floor(h)
    return i, h - i


def _interpolated(lo: float, hi: float, offset: int, count: int) -> float:
    """A rank's value guessed inside its cell: log-linear between the edges (linear from 0; the edge itself
    for a point cell or the open cell above the last edge)."""
    if lo == hi or math.isinf(hi):
        return lo
    u = (offset + 0.5) / count
    return lo + u * (hi - lo) if lo == 0 else lo * (hi / lo) ** u


def token_abs_quantiles(store: Store, runs: Sequence[str], keys: Sequence[str], steps: tuple[int, int] | None,
                        probs: Sequence[float]) -> pl.DataFrame:
    """[keys..., token_p<100p>..., token_exact] per group of `keys` (("run",) or ("run", "step")) over the tokens
    of `runs`: from the token rows where they are complete and the selection holds at most EXACT_TOKENS tokens,
    else interpolated in the histogram."""
    keys = list(keys)
    where, params = run_filter(runs, steps)
    counts = store.sql(f"SELECT {', '.join(keys)}, bin, sum(n_tokens)::BIGINT AS n FROM summary_hist "
                       f"WHERE {where} GROUP BY ALL HAVING sum(n_tokens) > 0", params)
    names = [f"token_p{round(p * 100)}" for p in probs]
    schema = {k: (pl.String if k == "run" else pl.Int64) for k in keys} | {c: pl.Float64 for c in names}
    schema["token_exact"] = pl.Boolean
    if counts.is_empty():
        return pl.DataFrame(schema=schema)
    exact_runs: set[str] = set()
    if int(counts["n"].sum()) <= EXACT_TOKENS:
        cov = read.coverage(store, runs)
        exact_runs = set(cov.filter(pl.col("complete"))["run"].to_list())
    cells = abs_cells()
    per_group: dict[tuple, dict[Cell, int]] = {}
    for row in counts.iter_rows():
        group, b, n = tuple(row[:-2]), row[-2], row[-1]
        g = per_group.setdefault(group, {})
        g[cells[b]] = g.get(cells[b], 0) + n
    out: dict[tuple, list] = {}
    wanted = []  # (group, column index, weight, cell, offset): a rank read from the token rows
    for group, g in per_group.items():
        order = sorted(g)
        starts, total = [], 0
        for c in order:
            starts.append(total)
            total += g[c]
        vals = out[group] = [0.0] * len(probs)

        def locate(rank: int) -> tuple[Cell, int]:
            j = bisect.bisect_right(starts, rank) - 1
            return order[j], rank - starts[j]
        for col, p in enumerate(probs):
            i, frac = _ranks(total, p)
            for rank, weight in ((i, 1.0 - frac), (i + 1, frac)):
                if weight == 0.0 or rank >= total:
                    continue
                cell, offset = locate(rank)
                if group[0] in exact_runs:
                    wanted.append((group, col, weight, cell, offset))
                else:
                    vals[col] += weight * _interpolated(*cell, offset, g[cell])
    if wanted:
        for (group, col, weight, _, _), value in zip(wanted, _order_statistics(store, runs, keys, steps, wanted)):
            out[group][col] += weight * value
    rows = [(*group, *vals, group[0] in exact_runs) for group, vals in sorted(out.items())]
    return pl.DataFrame(rows, schema=schema, orient="row")


def _order_statistics(store: Store, runs: Sequence[str], keys: list[str], steps, wanted) -> list[float]:
    """The value of each wanted (group, cell, offset): the offset-th smallest |Δ| (0-based) among the group's
    tokens inside the cell, in one pass over the token rows restricted to the wanted cells."""
    where, params = token_filter(store, runs, steps, alias="t")
    req = {"q_id": list(range(len(wanted))), "q_run": [w[0][0] for w in wanted],
           "q_step": [w[0][1] if len(keys) > 1 else None for w in wanted],
           "q_lo": [w[3][0] for w in wanted], "q_hi": [w[3][1] for w in wanted], "q_off": [w[4] for w in wanted]}
    distinct = sorted({w[3] for w in wanted})
    conds = []
    for j, (lo, hi) in enumerate(distinct):
        params[f"c_lo{j}"] = lo
        if lo == hi:
            conds.append(f"(a = $c_lo{j})")
        else:
            params[f"c_hi{j}"] = hi
            conds.append(f"(a > $c_lo{j} AND a < $c_hi{j})")
    step_on = " AND tok.step = req.step" if len(keys) > 1 else ""
    rows = store.rows(f"""
        WITH req AS (SELECT unnest($q_id) AS id, unnest($q_run) AS run, unnest($q_step::BIGINT[]) AS step,
                            unnest($q_lo::DOUBLE[]) AS lo, unnest($q_hi::DOUBLE[]) AS hi, unnest($q_off) AS off),
             tok AS (SELECT * FROM (SELECT t.run, t.step, abs(t.trainer_logprob - t.sampler_logprob) AS a
                                    FROM tokens t WHERE {where}) WHERE {' OR '.join(conds)})
        SELECT id, a FROM (
            SELECT req.id, req.off, tok.a, row_number() OVER (PARTITION BY req.id ORDER BY tok.a) - 1 AS rn
            FROM tok JOIN req ON tok.run = req.run{step_on}
            WHERE (req.lo = req.hi AND tok.a = req.lo) OR (tok.a > req.lo AND tok.a < req.hi))
        WHERE rn = off ORDER BY id""", params | req)
    if len(rows) != len(wanted):  # the histogram and the token rows disagree: a bug, not bad input
        raise RuntimeError(f"token rows do not match summary_hist: {len(rows)} of {len(wanted)} ranks found")
    return [a for _, a in rows]


def sequence_quantiles(store: Store, runs: Sequence[str], keys: Sequence[str], steps: tuple[int, int] | None,
                       probs: Sequence[float]) -> pl.DataFrame:
    """[keys..., seq_mean_p<..>..., seq_sum_p<..>...]: quantiles of |mean Δ| and |ΣΔ| over each group's sequences."""
    k = ", ".join(keys)
    where, params = run_filter(runs, steps)
    cols = [f"quantile_cont(abs(sum_d / n), {float(p)}) AS seq_mean_p{round(p * 100)}" for p in probs]
    cols += [f"quantile_cont(abs(sum_d), {float(p)}) AS seq_sum_p{round(p * 100)}" for p in probs]
    return store.sql(f"""
        SELECT {k}, {', '.join(cols)}
        FROM (SELECT *, n_tokens AS n FROM ({F.sequences_sql(where)}))
        GROUP BY {k} ORDER BY {k}""", params)


__all__ = ["token_abs_quantiles", "sequence_quantiles", "abs_cells"]
