"""NeMo RL's mismatch metrics by its own conventions, from sequence sums.

Read at NVIDIA-NeMo/RL 7ea279ab; "LF" is nemo_rl/algorithms/loss/loss_functions.py, "G" nemo_rl/algorithms/grpo.py
there. Every token metric is masked_mean(x, mask, global_normalization_factor=global_valid_toks) per micro-batch,
summed over micro-batches: the token mean over the whole batch, Σ x / (n + 1e-8) (nemo_rl/algorithms/utils.py
:212-224). Δ = t − s is never clamped. The loss sees prev_logprobs = the trainer's log-probs (t) and
generation_logprobs = the sampler's (s); curr_logprobs equals prev_logprobs on the first, on-policy micro-batch.
"""
from __future__ import annotations

import numpy as np

from analysis.metrics.frameworks import inputs as I

EPS = 1e-8  # nemo_rl/algorithms/utils.py:224@7ea279ab
DEFAULTS = {"kl_type": "k3", "seq_logprob_error_threshold": "none"}


def check(p: dict) -> dict:
    if p["kl_type"] not in ("k1", "k2", "k3"):
        raise ValueError(f"kl_type: expected k1, k2 or k3 (reference_policy_kl_type), got {p['kl_type']!r}")
    if p["seq_logprob_error_threshold"] != "none":
        p["seq_logprob_error_threshold"] = float(p["seq_logprob_error_threshold"])
    return p


def _kl(q, kl_type: str, reverse: bool) -> np.ndarray:
    """Σ calculate_kl per sequence (nemo_rl/algorithms/utils.py:72-90@7ea279ab), no input or output clamp
    (LF:416-422, 431-437): logr = reference − logprobs; gen_kl_error has logr = t − s = Δ, policy_kl_error −Δ."""
    if kl_type == "k1":   # kl = −logr
        return q["sum_d"] if reverse else -q["sum_d"]
    if kl_type == "k2":   # logr² / 2
        return 0.5 * q["sum_d2"]
    return I.sum_k3r_unclamped(q) if reverse else I.sum_k3_unclamped(q)  # e^logr − 1 − logr


def view(q, p: dict) -> dict[str, float]:
    N = q["n"].sum()
    mean = lambda per_seq: float(per_seq.sum() / (N + EPS))
    out = {
        "token_mult_prob_error": mean(I.sum_exp_abs(q)),               # LF:406-412 exp(|s − t|)
        "gen_kl_error": mean(_kl(q, p["kl_type"], reverse=False)),      # LF:416-427
        "policy_kl_error": mean(_kl(q, p["kl_type"], reverse=True)),    # LF:431-442
        # LF:447-466: ½ KL(P_train‖M) + ½ KL(P_gen‖M) per token with M the mixture; with e^u + e^v = 2 it is
        # log cosh(Δ/2), a function of Δ alone (schema.SEQ_SUMS)
        "js_divergence_error": mean(q["sum_js"]),
        "sampling_importance_ratio": mean(I.sum_r(q)),                 # LF:579-584, 704-708 token-level e^Δ
        "approx_entropy": -mean(q["sum_rt"] + q["ext_rt"]),            # LF:712-717 −mean(e^(curr − gen) · curr)
    }
    # G:2537-2640: per sequence Σ exp(|Δ|) / n over sequences with tokens; max, mean, min
    err = I.sum_exp_abs(q) / np.maximum(q["n"], 1.0)
    out |= {"max_seq_mult_prob_error": float(err.max()), "mean_seq_mult_prob_error": float(err.mean()),
            "min_seq_mult_prob_error": float(err.min())}
    kept = err
    if p["seq_logprob_error_threshold"] != "none":
        keep = err <= p["seq_logprob_error_threshold"]                 # G:2590-2592
        out["num_masked_seqs"] = float((~keep).sum())                  # G:2594-2595
        kept = err[keep]
    out |= {"max_seq_mult_prob_error_after_mask": float(kept.max()) if kept.size else 0.0,   # G:2605-2615
            "mean_seq_mult_prob_error_after_mask": float(kept.mean()) if kept.size else 0.0,
            "min_seq_mult_prob_error_after_mask": float(kept.min()) if kept.size else 0.0}
    return out
