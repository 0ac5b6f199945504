"""prime-rl's mismatch_kl statistics by its own conventions: from the token rows (its median needs them).

Read at PrimeIntellect-ai/prime-rl 559b4477: per trained token mismatch_kl = exp(Δ) − Δ − 1, Δ = t − s unclamped
(src/prime_rl/trainer/rl/loss.py:100-106), collected over the step's micro-batches and ranks
(src/prime_rl/trainer/rl/train.py:508-512) and logged as mean, median (torch.median: the lower middle value),
std (n − 1), min and max (src/prime_rl/trainer/utils.py:245-281). Per env name (`mismatch_kl/<env>`) is not
stored here; `all` is.
"""
from __future__ import annotations

from typing import Sequence

import polars as pl

from analysis.store import Store
from analysis.summaries.sql import series_k3_sql, token_filter

DEFAULTS: dict = {}
STATS = ("mean", "median", "std", "min", "max")


def check(p: dict) -> dict:
    return p


def table(store: Store, runs: Sequence[str], keys: list[str], steps) -> pl.DataFrame:
    """[keys..., mismatch_kl/all/{mean,median,std,min,max}] per group, from the token rows."""
    where, params = token_filter(store, runs, steps)
    # e^Δ − 1 − Δ: its series below |Δ| 0.01 (exp(Δ) − 1 − Δ cancels there), else as written
    k3 = f"(CASE WHEN abs(d) < 0.01 THEN {series_k3_sql('d')} ELSE exp(d) - 1.0 - d END)"
    k = ", ".join(keys)
    k_all = ", ".join(dict.fromkeys([*keys, "step", "sample"]))
    cols = {"mean": "favg(k3)", "median": "quantile_disc(k3, 0.5)", "std": "stddev_samp(k3)",
            "min": "min(k3)", "max": "max(k3)"}
    sel = ", ".join(f'{sql} AS "mismatch_kl/all/{name}"' for name, sql in cols.items())
    return store.sql(f"""SELECT {k}, count(*) AS n_tokens, count(DISTINCT (step, sample)) AS n_sequences, {sel} FROM (
        SELECT {k_all}, {k3} AS k3 FROM (SELECT {k_all}, trainer_logprob - sampler_logprob AS d FROM tokens WHERE {where}) d_)
        GROUP BY {k} ORDER BY {k}""", params)
