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

SAFETY_BOUND = 20.0  # mis.py:188@624b824a
FUNCTIONS = ("vanilla", "icepop", "mis")
LEVELS = ("token", "sequence", "geometric")
DEFAULTS = {"per_token_loss": False, "tis_function": "vanilla", "tis_clip": 2.0, "tis_clip_low": 0.0,
            # examples/train_infer_mismatch_helper/mis.py, used with
            # `--custom-tis-function-path ...mis.compute_mis_weights_with_cp`
            "use_tis": True, "tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0,
            "tis_lower_bound": "none", "use_rs": False, "rs_level": "token", "rs_lower_bound": "none",
            "rs_upper_bound": "none", "rs_veto_threshold": "none"}


def _opt(p: dict, key: str) -> float | None:
    v = p[key]
    if v == "none":
        return None
    try:
        return float(v)
    except ValueError:
        raise ValueError(f"{key}: a number or none, got {v!r}") from None


def check(p: dict) -> dict:
    if p["tis_function"] not in FUNCTIONS:
        raise ValueError(f"tis_function: expected one of {', '.join(FUNCTIONS)}, got {p['tis_function']!r}")
    if p["tis_function"] != "mis":
        clip, low = float(p["tis_clip"]), float(p["tis_clip_low"])
        I.band_params(clip)  # a cap the summaries' ratio bands answer
        if low not in (0.0,) and not math.isclose(low, 1.0 / clip, rel_tol=1e-12):
            raise ValueError(f"tis_clip_low: 0 or 1/tis_clip (the ratio bands the summaries keep), got {low:g}")
        return p
    for key, allowed in (("tis_level", LEVELS), ("rs_level", LEVELS), ("tis_mode", ("truncate", "clip", "mask"))):
        if p[key] not in allowed:
            raise ValueError(f"{key}: expected one of {', '.join(allowed)}, got {p[key]!r}")
    upper = float(p["tis_upper_bound"])
    lower = _opt(p, "tis_lower_bound")
    lower = 1.0 / upper if lower is None else lower                        # mis.py:174
    rs_lower = _opt(p, "rs_lower_bound")
    rs_lower = lower if rs_lower is None else rs_lower                     # mis.py:175
    rs_upper = _opt(p, "rs_upper_bound")
    rs_upper = upper if rs_upper is None else rs_upper                     # mis.py:176
    if p["tis_mode"] != "truncate" and not 0 <= lower < upper:             # mis.py:125, 140
        raise ValueError(f"tis_lower_bound must be below tis_upper_bound, got {lower:g} and {upper:g}")
    if p["use_rs"] and not 0 <= rs_lower < rs_upper:
        raise ValueError(f"rs_lower_bound must be below rs_upper_bound, got {rs_lower:g} and {rs_upper:g}")
    veto = _opt(p, "rs_veto_threshold")
    if veto is not None and not veto > 0:
        raise ValueError(f"rs_veto_threshold must be positive, got {veto:g}")
    p["_mis"] = {"lower": lower, "upper": upper, "rs_lower": rs_lower, "rs_upper": rs_upper, "veto": veto}
    bounds = cap(p)
    if isinstance(bounds, tuple):
        try:
            I.band_params(bounds)
        except ValueError:
            raise ValueError(f"token-level bounds {bounds[0]:g} and {bounds[1]:g}: the summaries' ratio bands "
                             "answer 1/C and C for C in 1.2, 1.5, 2, 3, 5, 10 (and the other band edges)") from None
    if p["use_tis"] and p["use_rs"] and p["rs_level"] == "token" and (rs_lower, rs_upper) != bounds:
        raise ValueError("rs_level token: the summaries' ratio bands answer one pair of token bounds: with "
                         "token-level TIS, rs_lower_bound and rs_upper_bound must be the TIS bounds (1/C and C in "
                         "truncate mode)")
    return p


def bands(p: dict) -> bool | str:
    """Per sequence for the per-sample reducer; with per_token_loss only their sums over the step's tokens."""
    return "group" if p["per_token_loss"] else True


def logprobs(p: dict) -> bool:
    return p["tis_function"] == "mis"


def cap(p: dict):
    """The token bounds whose ratio bands the view reads."""
    if p["tis_function"] != "mis":
        return float(p["tis_clip"])
    m = p["_mis"]
    if p["use_tis"] and p["tis_level"] == "token":
        return (m["lower"], m["upper"]) if p["tis_mode"] != "truncate" else (1.0 / m["upper"], m["upper"])
    if p["use_tis"] and p["use_rs"] and p["rs_level"] == "token":
        return (m["rs_lower"], m["rs_upper"])
    return 2.0


def below(p: dict) -> float | None:
    m = p.get("_mis")
    if m and p["use_tis"] and p["use_rs"] and m["veto"] is not None:
        return math.log(m["veto"])          # mis.py:92-94: unclamped Δ < ln τ
    return None


def _reducer(q, g: I.Groups, p: dict):
    """sum_of_sample_mean of per-sequence token sums (CP:47-124): per-sample means averaged over the step's
    samples, or with per_token_loss the token mean (CP:83-89; train_metric_utils.py:53-59)."""
    n = np.maximum(q["n"], 1.0)
    if p["per_token_loss"]:
        total = g.add(n)
        return lambda per_seq: g.add(per_seq) / total
    return lambda per_seq: g.add(per_seq / n) / g.count


def _mis(q, g: I.Groups, p: dict, reduce) -> dict[str, np.ndarray]:
    """compute_mis_weights (examples/train_infer_mismatch_helper/mis.py:150-307@624b824a), its metrics prefixed
    mis_ (mis.py:375-378) and reduced with the loss masks before rejection (L:1050-1059, 1156-1163). Each value
    is a per-token tensor; a per-sequence value v counts as v on each of the sequence's n tokens (sum n·v)."""
    n = q["n"]
    m = p["_mis"]
    mean_t, mean_s = q["sum_t"] / np.maximum(n, 1.0), q["sum_s"] / np.maximum(n, 1.0)   # mis.py:17-19
    lpd = mean_s - mean_t
    per_seq = {                                                        # add_ppl_metrics, mis.py:383-451
        "training_log_ppl": n * -mean_t, "training_ppl": n * np.exp(-mean_t),
        "rollout_log_ppl": n * -mean_s, "rollout_ppl": n * np.exp(-mean_s),
        "kl": -q["sum_d"],                                             # mis.py:407 s − t per token
        "k3_kl": I.sum_k3_unclamped(q),                                # mis.py:413-414 unclamped
        "log_ppl_diff": n * lpd, "log_ppl_abs_diff": n * np.abs(lpd), "ppl_ratio": n * np.exp(lpd),
        "chi2_token": n * (I.sum_ratio_sq(q) / np.maximum(n, 1.0) - 1.0),   # mis.py:435-442 ρ = e^clamp(Δ)
        "chi2_seq": n * (np.exp(2.0 * np.clip(q["sum_d"], -SAFETY_BOUND, SAFETY_BOUND)) - 1.0),  # mis.py:447-450
    }
    if p["use_tis"]:                                                   # mis.py:207-209
        lower, upper = m["lower"], m["upper"]
        level = p["tis_level"]
        if level == "token":
            r_sum = n + q["sum_rm1"]                                   # mis.py:221-223 e^clamp(Δ)
            hi, lo = q["n_hi"], q["n_lo"]                              # tokens with w > upper, w < lower
            mid = n - hi - lo + q["a_mid"]                             # Σ w over lower ≤ w ≤ upper
            below = lo + q["a_lo"]                                     # Σ w below lower
            w_min = np.exp(np.clip(q["min_d"], -SAFETY_BOUND, SAFETY_BOUND))
            w_max = np.exp(np.clip(q["max_d"], -SAFETY_BOUND, SAFETY_BOUND))
        else:
            x = q["sum_d"] if level == "sequence" else q["sum_d"] / np.maximum(n, 1.0)   # mis.py:192-200
            w = np.exp(np.clip(x, -SAFETY_BOUND, SAFETY_BOUND))
            r_sum, w_min, w_max = n * w, w, w
            hi, lo = n * (w > upper), n * (w < lower)
            mid, below = np.where((w >= lower) & (w <= upper), n * w, 0.0), np.where(w < lower, n * w, 0.0)
        per_seq["tis_weight_before_bound"] = r_sum                     # mis.py:224
        if p["tis_mode"] == "truncate":                                # mis.py:103-113: clamp(0, upper)
            per_seq["tis_truncate_fraction"] = hi
            after = mid + below + upper * hi
            f = lambda x: np.minimum(x, upper)
        elif p["tis_mode"] == "clip":                                  # mis.py:116-128
            per_seq["tis_clip_fraction_low"], per_seq["tis_clip_fraction_high"] = lo, hi
            after = mid + lower * lo + upper * hi
            f = lambda x: np.clip(x, lower, upper)
        else:                                                          # mis.py:131-147: weights kept as they are
            per_seq["tis_mask_fraction_low"], per_seq["tis_mask_fraction_high"] = lo, hi
            after = r_sum
            f = lambda x: x
        per_seq["tis_weight_after_bound"] = after                      # mis.py:239
        if p["use_rs"]:                                                # mis.py:244-263
            rl, ru = m["rs_lower"], m["rs_upper"]
            if p["rs_level"] == "token":    # check() allows only the bands' bounds here
                rs_lo, rs_hi = q["n_lo"], q["n_hi"]
            else:
                x = q["sum_d"] if p["rs_level"] == "sequence" else q["sum_d"] / np.maximum(n, 1.0)
                w = np.exp(np.clip(x, -SAFETY_BOUND, SAFETY_BOUND))
                rs_lo, rs_hi = n * (w < rl), n * (w > ru)
            per_seq["rs_mask_fraction_low"], per_seq["rs_mask_fraction_high"] = rs_lo, rs_hi
            if m["veto"] is not None:                                  # mis.py:82-100, raw Δ
                per_seq["rs_catastrophic_token_fraction"] = q["n_below"]
                per_seq["rs_catastrophic_seq_fraction"] = n * (q["n_below"] > 0)
        per_seq["is_ratio_mean_after_tis_rs"] = after                  # mis.py:265
        per_seq["is_ratio_mean_final"] = after                         # mis.py:303 (no batch normalisation)
        per_seq["is_ratio_min_final"] = n * f(w_min)                   # mis.py:304
        per_seq["is_ratio_max_final"] = n * f(w_max)                   # mis.py:305
    return {f"mis_{k}": reduce(v) for k, v in per_seq.items()}


def view(q, g: I.Groups, p: dict) -> dict[str, np.ndarray]:
    reduce = _reducer(q, g, p)
    out = {"train_rollout_logprob_abs_diff": reduce(q["sum_abs_d"])}  # L:1136-1140 |t − s|
    if p["tis_function"] == "mis":
        return out | _mis(q, g, p, reduce)
    r = I.sum_r(q)
    if p["tis_function"] == "vanilla":
        # L:884-905: tis = exp(Δ), clamped to [tis_clip_low, tis_clip]; clipfrac counts the tokens the clamp
        # changed: r > C, and r < tis_clip_low when it is 1/C
        clipped = q["n_hi"] + (q["n_lo"] if float(p["tis_clip_low"]) > 0 else 0.0)
    else:
        # L:908-931 icepop: r kept within [tis_clip_low, tis_clip], else 0; clipfrac counts the zeroed tokens (a
        # token whose r is already 0 is not changed: none, r > 0)
        clipped = q["n_hi"] + (q["n_lo"] if float(p["tis_clip_low"]) > 0 else 0.0)
    return out | {
        "tis": reduce(r),                                           # L:895, 919
        "tis_clipfrac": reduce(clipped),                            # L:897-898, 924
        "tis_abs": reduce(I.sum_abs_rm1(q)),                        # L:896, 920 |exp(Δ) − 1|
    }
