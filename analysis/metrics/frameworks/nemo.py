"""NeMo RL's mismatch metrics by its own conventions, from sequence sums.

Read at NVIDIA-NeMo/RL 7ea279ab; "LF" is nemo_rl/algorithms/loss/loss_functions.py, "G" nemo_rl/algorithms/grpo.py
there. Every token metric is masked_mean(x, mask, global_normalization_factor=global_valid_toks) per micro-batch,
summed over micro-batches: the token mean over the whole batch, Σ x / (n + 1e-8) (nemo_rl/algorithms/utils.py
:212-224). Δ = t − s is never clamped. The loss sees prev_logprobs = the trainer's log-probs (t) and
generation_logprobs = the sampler's (s); curr_logprobs equals prev_logprobs on the first, on-policy micro-batch.
"""
from __future__ import annotations

import math

import numpy as np

from analysis.metrics.frameworks import inputs as I
from analysis.summaries.schema import BAND_EDGES, CLAMP

EPS = 1e-8  # nemo_rl/algorithms/utils.py:224@7ea279ab
TIS_TYPES = ("none", "tis", "icepop", "seq-mask-tis")  # LF:146-149, 296-299@7ea279ab
DEFAULTS = {"kl_type": "k3", "seq_logprob_error_threshold": "none", "tis_type": "none", "tis_ratio": 2.0,
            "tis_ratio_min": "none"}


def _ratio_bound(value: float, name: str) -> None:
    """A token-level bound must be 0 or sit on a ratio-band edge of the summaries (ln of it in BAND_EDGES)."""
    if value != 0.0 and not any(math.isclose(math.log(value), e, rel_tol=1e-12, abs_tol=1e-15) for e in BAND_EDGES):
        edges = ", ".join(f"{math.exp(e):.6g}" for e in BAND_EDGES if abs(e) < CLAMP)
        raise ValueError(f"{name}: the summaries' ratio bands answer a token-level bound of 0 or one of {edges}; "
                         f"got {value:g}")


def check(p: dict) -> dict:
    if p["kl_type"] not in ("k1", "k2", "k3"):
        raise ValueError(f"kl_type: expected k1, k2 or k3 (reference_policy_kl_type), got {p['kl_type']!r}")
    if p["seq_logprob_error_threshold"] != "none":
        p["seq_logprob_error_threshold"] = float(p["seq_logprob_error_threshold"])
    if p["tis_type"] not in TIS_TYPES:
        raise ValueError(f"tis_type: expected one of {', '.join(TIS_TYPES)} (truncated_importance_sampling_type), "
                         f"got {p['tis_type']!r}")
    if p["tis_type"] == "none":
        return p
    hi = float(p["tis_ratio"])
    if not hi > 0:  # LF:304-307
        raise ValueError(f"tis_ratio must be positive, got {hi:g}")
    if p["tis_ratio_min"] == "none":
        if p["tis_type"] != "tis":  # LF:316-319
            raise ValueError(f"tis_type {p['tis_type']} needs tis_ratio_min (truncated_importance_sampling_ratio_min)")
        lo = 0.0  # LF:598-600
    else:
        lo = float(p["tis_ratio_min"])
    if not 0.0 <= lo <= hi:  # LF:308-315
        raise ValueError(f"tis_ratio_min must be within [0, tis_ratio], got {lo:g}")
    if p["tis_type"] != "seq-mask-tis":  # token-level bounds: counted from the ratio bands
        _ratio_bound(hi, "tis_ratio")
        _ratio_bound(lo, "tis_ratio_min")
    p["_tis"] = (lo, hi)
    return p


def bands(p: dict) -> bool | str:
    """Token-level TIS reads the ratio bands, summed over the batch's tokens only (`inputs._group_bands`)."""
    return p["tis_type"] in ("tis", "icepop") and "group"


def cap(p: dict) -> tuple[float, float]:
    """The ratio bounds whose bands the view reads (token-level TIS and ICE-POP)."""
    return p.get("_tis", (0.5, 2.0))


def rewards(p: dict) -> bool:
    return p["seq_logprob_error_threshold"] != "none"


def _kl(q, kl_type: str, reverse: bool) -> np.ndarray:
    """Σ calculate_kl per sequence (nemo_rl/algorithms/utils.py:72-90@7ea279ab), no input or output clamp
    (LF:416-422, 431-437): logr = reference − logprobs; gen_kl_error has logr = t − s = Δ, policy_kl_error −Δ."""
    if kl_type == "k1":   # kl = −logr
        return q["sum_d"] if reverse else -q["sum_d"]
    if kl_type == "k2":   # logr² / 2
        return 0.5 * q["sum_d2"]
    return I.sum_k3r_unclamped(q) if reverse else I.sum_k3_unclamped(q)  # e^logr − 1 − logr


def _importance(q, g: I.Groups, p: dict) -> dict[str, np.ndarray]:
    """sampling_importance_ratio (LF:704-708, token level) of the weights after truncation (LF:592-667), and
    is_oob_ratio with a truncation type. Token weights are e^Δ unclamped (LF:579-584)."""
    n = q["n"]
    N = g.add(n)
    mean = lambda per_seq: g.add(per_seq) / (N + EPS)
    if "_tis" not in p:
        return {"sampling_importance_ratio": mean(I.sum_r(q))}
    lo, hi = p["_tis"]
    if p["tis_type"] == "seq-mask-tis":
        # LF:641-660: geometric mean exp(Σ Δ / (n + 1e-8)) per sequence; kept within [min, max]; is_oob_ratio
        # over the batch's sequences (global_valid_seqs), the kept sequences keep their raw token weights
        geo = np.exp(q["sum_d"] / (n + EPS))
        kept = (geo >= lo) & (geo <= hi)
        return {"is_oob_ratio": g.add(~kept) / (g.count + EPS),
                "sampling_importance_ratio": mean(np.where(kept, I.sum_r(q), 0.0))}
    # token level, from the ratio bands at [lo, hi]: n_lo tokens with r < lo, n_hi with r > hi, a_mid = Σ (r − 1)
    # between (r = e^clamp(Δ); with lo = 0 the band also holds Δ < −20, whose e^Δ ext_r_lo corrects)
    below_clamp = q["ext_r_lo"] if lo == 0.0 else 0.0
    mid = n - q["n_lo"] - q["n_hi"] + q["a_mid"] + below_clamp     # Σ r over lo ≤ r ≤ hi
    if p["tis_type"] == "tis":   # LF:597-619: clamp(r, min, max)
        w = mid + hi * q["n_hi"] + lo * q["n_lo"]
    else:                        # icepop, LF:620-637: r kept within [min, max], else 0
        w = mid
    return {"is_oob_ratio": mean(q["n_lo"] + q["n_hi"]), "sampling_importance_ratio": mean(w)}


def view(q, g: I.Groups, p: dict) -> dict[str, np.ndarray]:
    N = g.add(q["n"])
    mean = lambda per_seq: g.add(per_seq) / (N + EPS)
    out = {
        "token_mult_prob_error": mean(I.sum_exp_abs(q)),               # LF:406-412 exp(|s − t|)
        "gen_kl_error": mean(_kl(q, p["kl_type"], reverse=False)),      # LF:416-427
        "policy_kl_error": mean(_kl(q, p["kl_type"], reverse=True)),    # LF:431-442
        # LF:447-466: ½ KL(P_train‖M) + ½ KL(P_gen‖M) per token with M the mixture; with e^u + e^v = 2 it is
        # log cosh(Δ/2), a function of Δ alone (schema.SEQ_SUMS)
        "js_divergence_error": mean(q["sum_js"]),
    }
    out |= _importance(q, g, p)
    out["approx_entropy"] = -mean(q["sum_rt"] + q["ext_rt"])      # LF:712-717 −mean(e^(curr − gen) · curr)
    # G:2537-2640: per sequence Σ exp(|Δ|) / n over sequences with tokens; max, mean, min
    err = I.sum_exp_abs(q) / np.maximum(q["n"], 1.0)
    out |= {"max_seq_mult_prob_error": g.max(err), "mean_seq_mult_prob_error": g.mean(err),
            "min_seq_mult_prob_error": g.min(err)}
    keep = np.ones(err.size, dtype=bool)
    if p["seq_logprob_error_threshold"] != "none":
        keep = err <= p["seq_logprob_error_threshold"]                 # G:2590-2592
        masked = g.add(~keep)
        out["num_masked_seqs"] = masked                                # G:2594-2595
        # G:2597-2602: of the masked sequences, the share with reward == 1; 0 when none is masked. Unknown (null)
        # when a masked sequence has no stored reward
        reward = q["reward"]
        correct = g.add(~keep & (reward == 1.0))
        unknown = g.add(~keep & np.isnan(reward))
        with np.errstate(divide="ignore", invalid="ignore"):
            out["masked_correct_pct"] = np.where(unknown > 0, np.nan,
                                                 np.where(masked > 0, correct / masked, 0.0))
    kept_n = g.add(keep)
    with np.errstate(invalid="ignore", divide="ignore"):             # G:2605-2615: 0 when every sequence is masked
        out |= {"max_seq_mult_prob_error_after_mask": np.where(kept_n > 0, g.max(np.where(keep, err, -np.inf)), 0.0),
                "mean_seq_mult_prob_error_after_mask": np.where(kept_n > 0, g.add(np.where(keep, err, 0.0)) / kept_n,
                                                                0.0),
                "min_seq_mult_prob_error_after_mask": np.where(kept_n > 0, g.min(np.where(keep, err, np.inf)), 0.0)}
    return out
