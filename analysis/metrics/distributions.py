"""Histograms of the log-ratio Δ = t − s and of r, binned in DuckDB so that charts get small frames.

The Δ and r histograms read the summaries' fixed global Δ bins (every token, cost independent of the number of
tokens); the 2-D probability density reads the token rows. Every function returns only non-empty bins
(step_histogram merges adjacent steps to stay under MAX_CELLS).
"""
from __future__ import annotations

import math

import numpy as np
import polars as pl

from analysis.metrics import sampled
from analysis.metrics import token as metrics
from analysis.store import Store
from analysis.summaries import schema as S
from analysis.summaries.finalise import edge_bin
from analysis.summaries.sql import check_runs, run_filter, token_filter

MAX_CELLS = 100_000  # most points a chart is ever sent


def _hist_schema(first: dict) -> dict:
    return {**first, "bin_lo": pl.Float64, "bin_hi": pl.Float64, "count": pl.Int64, "frac": pl.Float64}


def _check_bins(n_bins: int) -> int:
    if int(n_bins) < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    return int(n_bins)


# -- histograms from the summaries' fixed Δ bins -------------------------------------------------------------
# Display bins: the intervals between consecutive DISPLAY_EDGES (0 and ±10^(j/10), |Δ| from 1e-8 to 1000 at ten
# bins per decade), bin i = [DISPLAY_EDGES[i−1], DISPLAY_EDGES[i]), bin 0 and the last open outwards. Every
# display edge is an edge of the summaries' fine bins (schema.D_EDGES), so each fine bin falls in exactly one
# display bin and the counts are exact.
DISPLAY_EDGES = np.array(S.DISPLAY_EDGES)
N_DISPLAY_BINS = len(DISPLAY_EDGES) + 1
_OUTER = 10.0 ** 0.1  # the open outer bins are drawn one grid step wide


def display_bin(x: np.ndarray | float) -> np.ndarray:
    """Display bin of values x (the reference binning: [lo, hi) intervals of DISPLAY_EDGES)."""
    return np.searchsorted(DISPLAY_EDGES, x, side="right")


def _fine_to_display(clamp: bool) -> np.ndarray:
    """Display bin of each fine bin id of schema.D_EDGES (clamp=True: of the value clamped to ±CLAMP, so the
    fine bins beyond the clamp fall in the bin of ±CLAMP, as r = exp(clamp(Δ)) does)."""
    edges = np.array(S.D_EDGES)
    out = np.empty(S.N_BINS, dtype=np.int64)
    for b in range(S.N_BINS):
        k = b // 2
        if b % 2:  # exactly on edge k
            v = edges[k]
        else:  # open interval (edges[k−1], edges[k]): any value inside lies in the display bin of its lower end
            v = edges[k - 1] if k > 0 else -math.inf
            if clamp and k > 0 and v >= S.CLAMP:
                v = S.CLAMP
        if clamp:
            v = min(max(v, -S.CLAMP), S.CLAMP)
        out[b] = display_bin(v)
    return out


_TO_DISPLAY = {False: _fine_to_display(False), True: _fine_to_display(True)}


def display_edges(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi) of display bins `b` in Δ units (outer bins one grid step wide)."""
    ext = np.concatenate([[DISPLAY_EDGES[0] * _OUTER], DISPLAY_EDGES, [DISPLAY_EDGES[-1] * _OUTER]])
    return ext[b], ext[b + 1]


def _fine_counts(store: Store, runs: list[str], keys: list[str], steps: tuple[int, int] | None,
                 step_stride: tuple[int, int] | None = None) -> pl.DataFrame:
    """[keys..., bin, n]: tokens per fine Δ bin, merged over files (and steps outside `keys`)."""
    where, params = run_filter(runs, steps)
    step = "step"
    if step_stride is not None:
        params.update(first=step_stride[0], stride=step_stride[1])
        step = "$first + (step - $first) // $stride * $stride"
    cols = ", ".join(step + " AS step" if k == "step" else k for k in keys)
    return store.sql(f"""SELECT {cols}, bin, sum(n_tokens)::BIGINT AS n FROM summary_hist WHERE {where}
                         GROUP BY ALL""", params)


def _display(counts: pl.DataFrame, keys: list[str], clamp: bool = False) -> pl.DataFrame:
    """Fine counts -> [keys..., bin_lo, bin_hi, count, frac] on the display bins (Δ units), frac = count / all
    tokens of the group; non-empty bins only."""
    if counts.is_empty():
        return pl.DataFrame(schema=_hist_schema({k: counts.schema[k] for k in keys}))
    b = pl.Series("b", _TO_DISPLAY[clamp][counts["bin"].to_numpy()])
    df = (counts.with_columns(b).group_by(*keys, "b").agg(count=pl.col("n").sum())
          .with_columns(frac=pl.col("count").cast(pl.Float64) / pl.col("count").sum().over(keys)).sort(*keys, "b"))
    lo, hi = display_edges(df["b"].to_numpy())
    return df.select(*keys, pl.Series("bin_lo", lo, pl.Float64), pl.Series("bin_hi", hi, pl.Float64),
                     pl.col("count").cast(pl.Int64), "frac")


def _ratio(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(bin_lo=pl.col("bin_lo").clip(-S.CLAMP, S.CLAMP).exp(),
                           bin_hi=pl.col("bin_hi").clip(-S.CLAMP, S.CLAMP).exp())


def log_ratio_histogram(store: Store, runs: list[str], n_bins: int = 80,
                        steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Histogram of Δ = t − s = log(π_trainer/π_sampler) per run, from the summaries, on the fixed display bins
    (DISPLAY_EDGES: 0 and ±10^(j/10); `n_bins` is accepted for compatibility and ignored).
    Returns [run, bin_lo, bin_hi, count, frac], frac = count / tokens of the run (non-empty bins only).

    Example: Δ = (−0.1, 0, 0, 0.1) gives [−0.1, −0.0794): 1 token, [0, 1e-8): 2, [0.1, 0.126): 1.
    """
    return _display(_fine_counts(store, check_runs(runs), ["run"], steps), ["run"])


def ratio_histogram(store: Store, runs: list[str], n_bins: int = 80,
                    steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Histogram of the importance ratio r = exp(clamp(Δ, −20, 20)) per run on the display bins of log r
    (bin_lo/bin_hi in units of r; `n_bins` ignored). Returns [run, bin_lo, bin_hi, count, frac]."""
    return _ratio(_display(_fine_counts(store, check_runs(runs), ["run"], steps), ["run"], clamp=True))


def drift_histograms(store: Store, runs: list[str], n_bins: int = 80,
                     steps: tuple[int, int] | None = None) -> dict[str, pl.DataFrame]:
    """The Token drift page's three views of Δ per run from one read of the summaries' Δ bins.

    Returns {"log_ratio": log_ratio_histogram(runs), "ratio": ratio_histogram(runs), "extreme":
    metrics.extreme_token_curve(runs)} (default τ grid: each ln τ is an edge of the fine bins, so F(τ) is exact).
    """
    counts = _fine_counts(store, check_runs(runs), ["run"], steps)
    return {"log_ratio": _display(counts, ["run"]), "ratio": _ratio(_display(counts, ["run"], clamp=True)),
            "extreme": extreme_from_bins(counts, metrics.default_taus())}


def extreme_from_bins(counts: pl.DataFrame, taus: list[float]) -> pl.DataFrame:
    """F(τ) per run from fine Δ bin counts [run, bin, n]: tokens with |clamp Δ| > ln τ, i.e. Δ above the edge
    ln τ or below −ln τ (each τ must have ln τ on schema.D_EDGES, or be ≥ e^CLAMP, where F = 0)."""
    if counts.is_empty():
        return metrics.extreme_from_counts(pl.DataFrame(), [])
    taus = sorted(float(t) for t in taus)
    b = counts["bin"].to_numpy()
    c = np.zeros(len(b), dtype=np.int64)  # per fine bin: #{i: its tokens have |clamp Δ| > ln τ_i}
    for tau in taus:
        x = math.log(tau)
        if x >= S.CLAMP:
            continue
        c += (b > edge_bin(x, S.D_EDGES)) | (b < edge_bin(-x, S.D_EDGES))
    return metrics.extreme_from_counts(counts.select("run", pl.Series("c", c), "n"), taus)


def step_histogram(store: Store, run: str, n_bins: int = 60, steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """Histogram of Δ = t − s per step of one run (a step × Δ heatmap) on the fixed display bins (`n_bins`
    ignored), from the summaries. frac = count / tokens of the step. When steps × N_DISPLAY_BINS would exceed
    MAX_CELLS, consecutive steps are merged into groups of equal stride and `step` is the first of its group.
    Returns [step, bin_lo, bin_hi, count, frac] (non-empty cells only).
    """
    where, params = run_filter([run], steps)
    first, last = store.rows(f"SELECT min(step), max(step) FROM summary_step WHERE {where} AND n_tokens > 0",
                             params)[0]
    if first is None:
        return pl.DataFrame(schema=_hist_schema({"step": pl.Int64}))
    stride = max(1, math.ceil((last - first + 1) * N_DISPLAY_BINS / MAX_CELLS))
    counts = _fine_counts(store, [run], ["step"], steps, step_stride=(int(first), int(stride)))
    return _display(counts, ["step"])


def prob_density_2d(store: Store, runs: list[str], n_bins: int = 100,
                    steps: tuple[int, int] | None = None, thin: bool = False) -> pl.DataFrame:
    """2-D histogram of (x = exp s, y = exp t), the sampler and trainer probabilities of each token.

    `n_bins` × `n_bins` equal cells on [0, 1]², pooled over the selected runs; a perfect match lies on the
    diagonal. n_bins is capped at √MAX_CELLS. thin=True: on a selection of more than sampled.THIN_TOKENS
    tokens, only the steps `sampled.thin_steps` picks (every k-th). Returns [x_lo, x_hi, y_lo, y_hi, count]
    for non-empty cells.
    """
    n_bins = min(_check_bins(n_bins), math.isqrt(MAX_CELLS))
    runs = check_runs(runs)
    only = sampled.thin_steps(store, runs, [steps]).steps if thin else None
    where, params = token_filter(store, runs, steps, only_steps=only)
    params["n"] = n_bins
    df = store.sql(f"""
        SELECT least(floor(exp(sampler_logprob) * $n), $n - 1)::BIGINT AS bx,
               least(floor(exp(trainer_logprob) * $n), $n - 1)::BIGINT AS by_, count(*) AS count
        FROM tokens WHERE {where} GROUP BY bx, by_ ORDER BY bx, by_""", params)
    w = 1.0 / n_bins
    return df.select(x_lo=pl.col("bx") * w, x_hi=(pl.col("bx") + 1) * w, y_lo=pl.col("by_") * w,
                     y_hi=(pl.col("by_") + 1) * w, count=pl.col("count"))
