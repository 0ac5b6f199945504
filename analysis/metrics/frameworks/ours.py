"""METRICS.md version 3 token columns that match a framework's statistic, by our conventions (r = e^clamp(Δ, ±20),
plain means, no + 1e-8): the quantities of the framework views, named as ours. Not in `metrics` (its output
stays as it was); `more_token_columns` returns them per step or per run.

From the per-sequence summaries: log_ppl_abs_diff, ratio_std_clamped, ratio_abs_dev_mean, seq_mult_prob_error_*.
From the token rows: training_ppl, sampler_ppl (Σ s, Σ t per sequence), js_divergence (Σ log cosh(Δ/2)),
kl_k3_std and kl_k3_median (the per-token term).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import polars as pl

from analysis.metrics.frameworks import inputs as I
from analysis.store import Store
from analysis.summaries.sql import check_runs, token_filter, token_terms_sql

V3_COLUMNS = ("training_ppl", "sampler_ppl", "log_ppl_abs_diff", "ratio_std_clamped", "ratio_abs_dev_mean",
              "js_divergence", "seq_mult_prob_error_max", "seq_mult_prob_error_mean", "seq_mult_prob_error_min",
              "kl_k3_std", "kl_k3_median")


def group_columns(q, cap: float) -> dict[str, float]:
    """The summary- and sequence-derived V3_COLUMNS of one group (q: `inputs.arrays` of its sequences)."""
    n, N = q["n"], q["n"].sum()
    sw, sw2 = I.clamped_weight_sums(q, cap)
    mean_w = sw.sum() / N
    mpe = 1.0 + q["sum_mpe"] / n       # per sequence mean exp(|clamp Δ|)
    return {
        "training_ppl": float(np.exp(-q["sum_t"] / n).mean()),
        "sampler_ppl": float(np.exp(-q["sum_s"] / n).mean()),
        "log_ppl_abs_diff": float(np.abs(q["sum_d"] / n).mean()),
        # population std of w = clamp(r, 1/C, C): Σ (w − 1)² / N − (Σ (w − 1) / N)², no cancellation near r = 1
        "ratio_std_clamped": float(math.sqrt(max((sw2.sum() - 2.0 * sw.sum() + N) / N - (mean_w - 1.0) ** 2, 0.0))),
        "ratio_abs_dev_mean": float((q["rm1_pos"] - q["rm1_neg"]).sum() / N),
        "js_divergence": float(q["sum_js"].sum() / N),
        "seq_mult_prob_error_max": float(mpe.max()), "seq_mult_prob_error_mean": float(mpe.mean()),
        "seq_mult_prob_error_min": float(mpe.min()),
    }


def more_token_columns(store: Store, runs: Sequence[str], by: str = "step", cap: float = 2.0,
                       steps: tuple[int, int] | None = None) -> pl.DataFrame:
    """[run, (step,) V3_COLUMNS...] (METRICS.md version 3, "More token columns"), C = `cap` (schema.CAPS)."""
    if by not in ("step", "run"):
        raise ValueError(f"by must be 'step' or 'run', got {by!r}")
    runs = check_runs(runs)
    keys = ["run", "step"] if by == "step" else ["run"]
    seqs = I.sequence_inputs(store, runs, steps, cap, logprobs=True)
    rows = []
    for key, group in seqs.group_by(keys, maintain_order=True):
        rows.append(dict(zip(keys, key)) | group_columns(I.arrays(group), cap))
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
