"""slime's mismatch metrics by its own conventions, from sequence sums.

Read at THUDM/slime 624b824a; "L" is slime/backends/megatron_utils/loss.py, "CP" .../cp_utils.py there. Every
metric goes through the reducer `sum_of_sample_mean` (CP:47-124): by default each sample's token mean (over
its loss mask, denominator at least 1), summed and divided by the step's number of samples
(slime/observability/train_metric_utils.py:53-59): a mean over samples. With --calculate-per-token-loss
(`--param per_token_loss=true`) it is the token mean over the step. Δ = t − s is never clamped here.
A sample whose loss mask is all zero counts in slime's divisor; it is not stored here (no trained token).
"""
from __future__ import annotations

import math

import numpy as np

from analysis.metrics.frameworks import inputs as I

DEFAULTS = {"per_token_loss": False, "tis_clip": 2.0, "tis_clip_low": 0.0}


def check(p: dict) -> dict:
    cap, low = float(p["tis_clip"]), float(p["tis_clip_low"])
    I.band_params(cap)  # a cap the summaries' ratio bands answer
    if low not in (0.0,) and not math.isclose(low, 1.0 / cap, rel_tol=1e-12):
        raise ValueError(f"tis_clip_low: 0 or 1/tis_clip (the ratio bands the summaries keep), got {low:g}")
    return p


def view(q, p: dict) -> dict[str, float]:
    n = q["n"]
    if p["per_token_loss"]:
        reduce = lambda per_seq: float(per_seq.sum() / np.maximum(n, 1.0).sum())       # CP:83-89, 124
    else:
        reduce = lambda per_seq: float((per_seq / np.maximum(n, 1.0)).sum() / n.size)  # CP:73-81
    # L:895-898 vanilla_tis_function: tis = exp(Δ), clamped to [tis_clip_low, tis_clip]; clipfrac counts the
    # tokens the clamp changed: r > C, and r < tis_clip_low when it is 1/C
    clipped = q["n_hi"] + (q["n_lo"] if float(p["tis_clip_low"]) > 0 else 0.0)
    return {
        "train_rollout_logprob_abs_diff": reduce(q["sum_abs_d"]),   # L:1136-1140 |t − s|
        "tis": reduce(I.sum_r(q)),                                  # L:895, 1161-1163
        "tis_clipfrac": reduce(clipped),                            # L:897-898
        "tis_abs": reduce(I.sum_abs_rm1(q)),                        # L:896 |exp(Δ) − 1|
    }
