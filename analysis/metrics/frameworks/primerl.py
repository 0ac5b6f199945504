"""prime-rl's mismatch_kl statistics by its own conventions: from the token rows (its median needs them).

Read at PrimeIntellect-ai/prime-rl 559b4477: per trained token mismatch_kl = exp(Δ) − Δ − 1, Δ = t − s unclamped
(src/prime_rl/trainer/rl/loss.py:100-106, computed as written there), collected over the step's micro-batches and
ranks (src/prime_rl/trainer/rl/train.py:508-512) and logged as mean, median (torch.median: the lower middle
value), std (n − 1), min and max (src/prime_rl/trainer/utils.py:245-281). Per env name (`mismatch_kl/<env>`) is
not stored here; `all` is. max_vio from expert_load (routing), see `layer_max_vio`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl

from analysis.store import Store
from analysis.summaries.sql import run_filter, token_filter

DEFAULTS: dict = {"try_to_avoid_padding_experts": True, "num_experts": 0, "load_side": "trainer"}
STATS = ("mean", "median", "std", "min", "max")


def check(p: dict) -> dict:
    if int(p["num_experts"]) < 0:
        raise ValueError(f"num_experts: the model's number of experts (0: the largest expert id seen + 1), "
                         f"got {p['num_experts']}")
    if p["load_side"] not in ("trainer", "sampler"):
        raise ValueError(f"load_side: trainer or sampler, got {p['load_side']!r}")
    return p


# loss.py:100-106@559b4477 as written: importance_ratio − log_importance_ratio − 1 (no series near Δ = 0: prime-rl
# logs the literal value, and the literal is ~0.1 s cheaper per 8M tokens here)
K3_SQL = "(exp(d) - d - 1.0)"


def table(store: Store, runs: Sequence[str], keys: list[str], steps, p: dict | None = None) -> pl.DataFrame:
    """[keys..., n_tokens, n_sequences, mismatch_kl/all/{mean,median,std,min,max}, and where the runs have
    routing max_vio/{mean,median,std,min,max}] per group: mismatch_kl from one pass over the token rows (its
    median and std need every token), max_vio from expert_load."""
    p = check(dict(DEFAULTS) | (p or {}))
    where, params = token_filter(store, runs, steps)
    k = ", ".join(keys)
    k_all = ", ".join(dict.fromkeys([*keys, "step", "sample"]))
    cols = {"mean": "favg(k3)", "median": "quantile_disc(k3, 0.5)", "std": "stddev_samp(k3)",
            "min": "min(k3)", "max": "max(k3)"}
    sel = ", ".join(f'{sql} AS "mismatch_kl/all/{name}"' for name, sql in cols.items())
    out = store.sql(f"""SELECT {k}, count(*) AS n_tokens, count(DISTINCT (step, sample)) AS n_sequences, {sel} FROM (
        SELECT {k_all}, {K3_SQL} AS k3
        FROM (SELECT {k_all}, trainer_logprob - sampler_logprob AS d FROM tokens WHERE {where}) d_)
        GROUP BY {k} ORDER BY {k}""", params)
    vio = max_vio(store, runs, keys, steps, p)
    if vio is not None and vio.height:
        out = out.join(vio, on=keys, how="left", maintain_order="left")
    return out


def layer_max_vio(store: Store, runs: Sequence[str], steps, p: dict) -> pl.DataFrame | None:
    """[run, step, layer, max_vio] from expert_load, as get_load_balance_stats (src/prime_rl/trainer/model.py
    :561-590@559b4477) with the step as one micro-step: tokens_per_expert holds every expert of the model
    (`num_experts`; 0 = the largest expert id seen in the run + 1, the experts no token reached count 0),
    sorted descending less its top_k largest with try_to_avoid_padding_experts (model.py:574-575);
    max_vio = (max − mean) / mean (model.py:576-577). None without routing."""
    where, params = run_filter(runs, steps)
    col = "n_trainer" if p["load_side"] == "trainer" else "n_sampler"
    # per (step, layer): the total, the sum of the top_k largest loads and the largest load after them, so
    # that only one row per (step, layer) leaves DuckDB (not one per expert)
    cells = store.sql(f"""
        WITH l AS (SELECT run, step, layer, expert, sum({col})::DOUBLE AS n FROM expert_load WHERE {where}
                   GROUP BY ALL),
             r AS (SELECT *, row_number() OVER (PARTITION BY run, step, layer ORDER BY n DESC) AS rk FROM l),
             k AS (SELECT run, step, layer, max(k)::BIGINT AS k FROM summary_layer WHERE {where} GROUP BY ALL),
             e AS (SELECT run, max(expert) + 1 AS seen FROM l GROUP BY run)
        SELECT r.run, r.step, r.layer, coalesce(any_value(k.k), 0) AS k, any_value(e.seen) AS seen,
               sum(r.n) AS total, coalesce(sum(r.n) FILTER (WHERE r.rk <= coalesce(k.k, 0)), 0) AS top,
               coalesce(max(r.n) FILTER (WHERE r.rk > coalesce(k.k, 0)), 0) AS peak_rest, max(r.n) AS peak
        FROM r JOIN e USING (run) LEFT JOIN k USING (run, step, layer)
        GROUP BY r.run, r.step, r.layer ORDER BY r.run, r.step, r.layer""", params)
    if not cells.height:
        return None
    seen = cells["seen"].to_numpy().astype(np.int64)
    n_exp = np.full(seen.size, int(p["num_experts"])) if int(p["num_experts"]) else seen
    if (seen > n_exp).any():
        i = int(np.argmax(seen > n_exp))
        raise ValueError(f"num_experts {int(n_exp[i])}: run {cells['run'][i]!r} routes to expert {int(seen[i]) - 1}")
    k = cells["k"].to_numpy().astype(np.float64)
    total = cells["total"].to_numpy()
    if p["try_to_avoid_padding_experts"]:
        mean = (total - cells["top"].to_numpy()) / np.maximum(n_exp - k, 1.0)
        peak = cells["peak_rest"].to_numpy()   # 0 when no more than top_k experts were reached: the rest are 0
    else:
        mean, peak = total / n_exp, cells["peak"].to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        vio = (peak - mean) / mean
    return cells.select("run", "step", "layer").with_columns(max_vio=pl.Series("max_vio", vio.tolist(), pl.Float64))


def max_vio(store: Store, runs: Sequence[str], keys: list[str], steps, p: dict) -> pl.DataFrame | None:
    """max_vio/{mean,median,std,min,max} per group over its (step, layer) values (trainer/utils.py:245-281:
    torch.median is the lower middle value, std n − 1)."""
    per = layer_max_vio(store, runs, steps, p)
    if per is None:
        return None
    v = pl.col("max_vio")
    return per.group_by(keys, maintain_order=True).agg(
        v.mean().alias("max_vio/mean"), v.quantile(0.5, interpolation="lower").alias("max_vio/median"),
        v.std(ddof=1).alias("max_vio/std"), v.min().alias("max_vio/min"), v.max().alias("max_vio/max")).sort(keys)
