"""Full-distribution and routing-weight terms (METRICS.md v3), per position / per routing row, in numpy.

The formulas of the columns `topk_*`, `top1_agree` and `weight_abs_diff_*`, written once for the arrays that
ingest reads (the trainer's torch twin is analysis/record/fulldist.py; tests check both against a brute-force
reference). Everything is float64 and vectorised over rows; nothing here reads files or the database.

Per position with the top-J ids and log-probs of both sides: I = S_s ∩ S_t, p = exp(log-prob), m_s = Σ_{i∈I} p_s(i),
m_t likewise, p̂ = p / m over I:
  overlap   = |I| / J
  agree     = 𝟙[argmax of side s = argmax of side t]   (each side's argmax: the first id with its largest log-prob)
  mass_s    = Σ_{i∈S_s} p_s(i),  mass_t = Σ_{i∈S_t} p_t(i)
  kl        = Σ_{i∈I} p̂_s(i) ((ls_i − lt_i) − (log m_s − log m_t))   (= KL(p̂_s ‖ p̂_t); 0 when |I| <= 1)
  tv_lower  = ½ Σ_{i∈I} |p_s(i) − p_t(i)| + ½ |m_s − m_t|
  tv_upper  = ½ Σ_{i∈I} |p_s(i) − p_t(i)| + ½ (1 − m_s) + ½ (1 − m_t)
The TV bounds hold for the full vocabulary: outside I the two sides' masses are 1 − m_s and 1 − m_t, whose TV
share is at least ½ |m_s − m_t| and at most ½ (1 − m_s) + ½ (1 − m_t).
"""
from __future__ import annotations

import numpy as np

# the per-position terms, in the order of schema.TOPK_SUMS after n_topk (n_top1_agree sums `agree`)
TOPK_TERMS = ("overlap", "agree", "mass_sampler", "mass_trainer", "kl_shared", "tv_lower", "tv_upper")
TOPK_SUM_OF = dict(zip(TOPK_TERMS, ("sum_topk_overlap", "n_top1_agree", "sum_topk_mass_sampler",
                                    "sum_topk_mass_trainer", "sum_topk_kl_shared", "sum_topk_tv_lower",
                                    "sum_topk_tv_upper")))
CHUNK = 1 << 15  # rows per block of the [rows, J, J] id comparison


def topk_terms(s_ids: np.ndarray, s_lp: np.ndarray, t_ids: np.ndarray, t_lp: np.ndarray) -> dict[str, np.ndarray]:
    """TOPK_TERMS per row of [n, J] ids (distinct within a row) and log-probs of both sides (float64 out)."""
    n, J = s_ids.shape
    out = {name: np.empty(n, np.float64) for name in TOPK_TERMS}
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        a_id, b_id = s_ids[lo:hi], t_ids[lo:hi]
        a, b = s_lp[lo:hi].astype(np.float64), t_lp[lo:hi].astype(np.float64)
        eq = a_id[:, :, None] == b_id[:, None, :]  # [c, J, J]: sampler id i is trainer id j
        shared = eq.any(2)
        b_m = np.where(eq, b[:, None, :], 0.0).sum(2)  # the trainer's log-prob of each shared sampler id
        ps, pt = np.exp(a), np.exp(b)
        pt_m = np.where(shared, np.exp(b_m), 0.0)
        ps_m = np.where(shared, ps, 0.0)
        ms, mt = ps_m.sum(1), pt_m.sum(1)
        n_i = shared.sum(1)
        l1 = np.abs(ps_m - pt_m).sum(1)
        many = n_i >= 2
        safe_ms, safe_mt = np.where(many, ms, 1.0), np.where(many, mt, 1.0)
        shift = (np.log(safe_ms) - np.log(safe_mt))[:, None]
        kl = np.where(shared, (ps_m / safe_ms[:, None]) * ((a - b_m) - shift), 0.0).sum(1)
        rows = np.arange(hi - lo)
        out["overlap"][lo:hi] = n_i / J
        out["agree"][lo:hi] = a_id[rows, a.argmax(1)] == b_id[rows, b.argmax(1)]
        out["mass_sampler"][lo:hi] = ps.sum(1)
        out["mass_trainer"][lo:hi] = pt.sum(1)
        out["kl_shared"][lo:hi] = np.where(many, kl, 0.0)
        out["tv_lower"][lo:hi] = 0.5 * l1 + 0.5 * np.abs(ms - mt)
        out["tv_upper"][lo:hi] = 0.5 * l1 + 0.5 * (1.0 - ms) + 0.5 * (1.0 - mt)
    return out


def weight_abs_diff(s_ids: np.ndarray, t_ids: np.ndarray, s_w: np.ndarray, t_w: np.ndarray) -> np.ndarray:
    """Σ_k |w_s(e_k) − w_t(e_k)| per row of [n, K] expert ids and weights, matched by expert id (float64), for
    rows whose two id sets are equal (the caller picks them): w_t(e) is the trainer weight at e's rank in t_ids."""
    n, K = s_ids.shape
    out = np.empty(n, np.float64)
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        eq = s_ids[lo:hi, :, None] == t_ids[lo:hi, None, :]
        tw = np.where(eq, t_w[lo:hi, None, :].astype(np.float64), 0.0).sum(2)
        out[lo:hi] = np.abs(s_w[lo:hi].astype(np.float64) - tw).sum(1)
    return out
