"""METRICS.md version 3 token columns that match a framework's statistic, by our conventions (r = e^clamp(Δ, ±20),
plain means, no + 1e-8): the quantities of the framework views, named as ours. Not in `metrics` (its output
stays as it was); `more_token_columns` returns them per step or per run.

From the per-sequence summaries: log_ppl_abs_diff, ratio_std_clamped, ratio_abs_dev_mean, seq_mult_prob_error_*.
From the token rows: training_ppl, sampler_ppl (Σ s, Σ t per sequence), js_divergence (Σ log cosh(Δ/2)),
kl_k3_std and kl_k3_median (the per-token term).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import polars as pl

from analysis.metrics.frameworks import inputs as I
from analysis.store import Store
from analysis.summaries.sql import check_runs, token_filter, token_terms_sql

V3_COLUMNS = ("training_ppl", "sampler_ppl", "log_ppl_abs_diff", "ratio_std_clamped", "ratio_abs_dev_mean",
              "js_divergence", "seq_mult_prob_error_max", "seq_mult_prob_error_mean", "seq_mult_prob_error_min",
              "kl_k3_std", "kl_k3_median")


def group_columns(q, g: I.Groups, cap: float) -> dict[str, np.ndarray]:
    """The summary- and sequence-derived V3_COLUMNS of every group of `g` (q: `inputs.sequence_arrays`)."""
    n, N = q["n"], g.add(q["n"])
    sw, sw2 = I.clamped_weight_sums(q, cap)
    mean_w = g.add(sw) / N
    mpe = 1.0 + q["sum_mpe"] / n       # per sequence mean exp(|clamp Δ|)
    return {
        "training_ppl": g.mean(np.exp(-q["sum_t"] / n)),
        "sampler_ppl": g.mean(np.exp(-q["sum_s"] / n)),
        "log_ppl_abs_diff": g.mean(np.abs(q["sum_d"] / n)),
        # population std of w = clamp(r, 1/C, C): Σ (w − 1)² / N − (Σ (w − 1) / N)², no cancellation near r = 1
        "ratio_std_clamped": np.sqrt(np.maximum((g.add(sw2) - 2.0 * g.add(sw) + N) / N - (mean_w - 1.0) ** 2, 0.0)),
        "ratio_abs_dev_mean": g.add(q["rm1_pos"] - q["rm1_neg"]) / N,
        "js_divergence": g.add(q["sum_js"]) / N,
        "seq_mult_prob_error_max": g.max(mpe), "seq_mult_prob_error_mean": g.mean(mpe),
        "seq_mult_prob_error_min": g.min(mpe),
    }


def more_token_columns(store: Store, runs: Sequence[str], by: str = "step", cap: float = 2.0,
                       steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """[run, (step,) V3_COLUMNS...] (METRICS.md version 3, "More token columns"), C = `cap` (schema.CAPS)."""
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    runs = sorted(set(check_runs(runs)))  # rows in run-name order
    keys = ["run", "step"] if by == "step" else ["run"]
    q = I.sequence_arrays(store, runs, steps, cap, logprobs=True, bands="group")
    starts = I.group_starts(q, ["_run", "step"] if by == "step" else ["_run"])
    g = I.Groups(starts)
    rows = []
    if starts.size > 1:
        head = {"run": [runs[i] for i in q["_run"][g.first].tolist()], "step": q["step"][g.first].tolist()}
        vals = {k: v.tolist() for k, v in group_columns(q, g, cap).items()}
        rows = [{k: head[k][i] for k in keys} | {c: vals[c][i] for c in vals} for i in range(g.first.size)]
    where, params = token_filter(store, runs, steps)
    k = ", ".join(keys)
    k3 = store.sql(f"""SELECT {k}, stddev_samp(k3) AS kl_k3_std, quantile_cont(k3, 0.5) AS kl_k3_median
        FROM ({token_terms_sql(f"SELECT {k}, sampler_logprob AS s, trainer_logprob AS t FROM tokens WHERE {where}")}) t_
        GROUP BY {k}""", params)
    if not rows:
        return pl.DataFrame(schema={**{c: (pl.String if c == "run" else pl.Int64) for c in keys},
                                    **{c: pl.Float64 for c in V3_COLUMNS}})
    df = pl.DataFrame(rows).join(k3, on=keys, how="left")
    return df.select(*keys, *V3_COLUMNS).sort(keys)
