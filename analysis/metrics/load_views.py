"""The Expert load page's views of one run, from one read of the `expert_load` aggregate (metrics/load.py).

Everything here is the page's arithmetic, so the page only lays out: shares normalised to the fair share, tokens
per rank over a placement, per-step means of the load columns, the hot set's size over time and its persistence.
"""
from __future__ import annotations

import numpy as np
import polars as pl

from analysis.metrics import hot_experts as H
from analysis.metrics import load as L
from analysis.store import Store

# Which definition each engine or trainer logs, so a user can match their own log (sources: metrics/load.py)
DEFINITIONS = pl.DataFrame({
    "column": ["rank_balancedness", "rank_imbalance", "straggler", "load_max_vio_all", "load_max_vio_primerl",
               "load_max_vio", "load_cv", "load_entropy_norm", "load_hot_experts"],
    "formula": ["mean_r c_r / max_r c_r", "max_r c_r / mean_r c_r − 1", "max_r c_r / mean_r c_r",
                "(max_e c_e − mean) / mean, all n experts", "the same without the top_k most loaded experts",
                "(max_e c_e − mean) / mean, experts seen", "std_e c_e / mean, all n experts", "H(c / Σc) / ln n",
                "#{e: c_e > 2 · mean}"],
    "logged by": ["vLLM EPLB `balancedness` (summed over layers: Σ mean / Σ max); SGLang `[Expert Balancedness]`",
                  "TensorRT-LLM `imbalance-ratio` (report_load_statistics.py)", "— (time vs perfect balance)",
                  "verl `rollout/moe/max_vio`, Tinker `e_max_violation`", "prime-rl `max_vio` (needs top_k)",
                  "— (Driftscope's load_max_vio_*, version 2)", "—", "—", "—"],
})


def views(store: Store, run: str, steps: tuple[int, int] | None = None, side: str = "sampler",
          n_experts: int | None = None, ep_size: int | None = None) -> dict[str, object]:
    """{name: frame or value} for the page:

    by_step [step, <load columns>_<side> averaged over layers, straggler_step]; heatmap [layer, expert, ratio]:
    the expert's tokens over the selected steps / the layer's fair share (Σ tokens / n); ranks [layer, rank,
    ratio] the same per rank (absent without a placement); straggler [layer, straggler_mean, straggler_pooled]:
    the mean over steps of max/mean per step, and max/mean of the summed steps; hot [step, layer, n_hot];
    persistence (hot_experts.persistence); n_experts, n_experts_source, placement (its source or None), n_ranks."""
    if side not in L.SIDES:
        raise ValueError(f"side must be one of {', '.join(L.SIDES)}")
    cube = L.counts_cube(store, run, steps, n_experts)
    place = L.run_placement(store, run, cube, ep_size)
    table = L.table_of(run, cube, place)
    c = cube.n[side]
    n = cube.n_experts
    cols = [f"{k}_{side}" for k in (*L.EXPERT_COLUMNS, *(L.RANK_COLUMNS if place else ()))]
    by_step = table.group_by("run", "step").agg(
        *(pl.col(k).mean() for k in cols),
        *([pl.col(f"straggler_step_{side}").first()] if place else [])).sort("step")
    pooled = c.sum(0)  # [layer, expert]
    fair = pooled.sum(-1, keepdims=True) / n
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(fair > 0, pooled / np.where(fair > 0, fair, 1), np.nan)
    Ly = len(cube.layers)
    out: dict[str, object] = {
        "by_step": by_step,
        "heatmap": pl.DataFrame({"layer": np.repeat(cube.layers, n).astype(np.int64),
                                 "expert": np.tile(np.arange(n), Ly).astype(np.int64),
                                 "ratio": ratio.reshape(-1)}).with_columns(pl.col("ratio").fill_nan(None)),
        "n_experts": n, "n_experts_source": cube.n_experts_source,
        "placement": place.source if place else None, "n_ranks": place.n_ranks if place else None,
    }
    if place is not None:
        r = L.rank_array(c, place)  # [step, layer, rank]
        rp = r.sum(0)
        mean = rp.mean(-1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            rr = np.where(mean > 0, rp / np.where(mean > 0, mean, 1), np.nan)
            per_step = L.rank_columns(r)["straggler"]
        R = place.n_ranks
        out["ranks"] = pl.DataFrame({"layer": np.repeat(cube.layers, R).astype(np.int64),
                                     "rank": np.tile(np.arange(R), Ly).astype(np.int64),
                                     "ratio": rr.reshape(-1)}).with_columns(pl.col("ratio").fill_nan(None))
        out["straggler"] = pl.DataFrame({
            "layer": cube.layers.astype(np.int64),
            "straggler_mean": _nanmean0(per_step, Ly),
            "straggler_pooled": L.rank_columns(rp)["straggler"]}).with_columns(pl.col(pl.Float64).fill_nan(None))
    total = c.sum(-1, keepdims=True)
    hot = (c > L.HOT_FACTOR * total / n).sum(-1)
    S = len(cube.steps)
    out["hot"] = pl.DataFrame({"step": np.repeat(cube.steps, Ly).astype(np.int64),
                               "layer": np.tile(cube.layers, S).astype(np.int64),
                               "n_hot": hot.reshape(-1).astype(np.int64)})
    out["persistence"] = H.persistence_of(c, cube.layers)
    return out


def _nanmean0(a: np.ndarray, width: int) -> np.ndarray:
    """Mean over axis 0 ignoring NaN; NaN where a column has no value (no warning)."""
    ok = ~np.isnan(a)
    n = ok.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.where(ok, a, 0.0).sum(0) / np.where(n > 0, n, 1), np.nan) if len(a) \
            else np.full(width, np.nan)


def layer_timeline(store: Store, run: str, layer: int, steps: tuple[int, int] | None = None, side: str = "sampler",
                   n_experts: int | None = None) -> pl.DataFrame:
    """[step, expert, ratio, hot] of one layer: the expert's tokens at the step over the fair share, and hot
    (ratio > 2), for the page's step × expert timeline."""
    cube = L.counts_cube(store, run, steps, n_experts, layers=[int(layer)])
    if not len(cube.layers):
        return pl.DataFrame(schema={"step": pl.Int64, "expert": pl.Int64, "ratio": pl.Float64, "hot": pl.Boolean})
    c = cube.n[side][:, 0, :]
    fair = c.sum(-1, keepdims=True) / cube.n_experts
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(fair > 0, c / np.where(fair > 0, fair, 1), np.nan)
    S, n = c.shape
    return pl.DataFrame({"step": np.repeat(cube.steps, n).astype(np.int64),
                         "expert": np.tile(np.arange(n), S).astype(np.int64), "ratio": ratio.reshape(-1),
                         "hot": (ratio > L.HOT_FACTOR).reshape(-1)}).with_columns(pl.col("ratio").fill_nan(None))
