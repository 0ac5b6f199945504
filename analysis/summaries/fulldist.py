"""Full-distribution sums (METRICS.md v3 "Full distribution") of top-J lists on the CPU: one numba pass per rows.

The formulas of the columns `topk_*` and `top1_agree`, for the arrays that ingest reads and for DriftLogger's
tensors on the CPU (its torch twin for accelerators is analysis/record/fulldist.py; tests check both against a
brute-force reference). Per position with the top-J ids and log-probs of both sides: I = S_s ∩ S_t,
p = exp(log-prob), m_s = Σ_{i∈I} p_s(i), m_t likewise, p̂ = p / m over I:
  overlap   = |I| / J
  agree     = 𝟙[argmax of side s = argmax of side t]   (each side's argmax: the first id with its largest log-prob)
  mass_s    = Σ_{i∈S_s} p_s(i),  mass_t = Σ_{i∈S_t} p_t(i)
  kl        = Σ_{i∈I} p̂_s(i) ((ls_i − lt_i) − (log m_s − log m_t))   (= KL(p̂_s ‖ p̂_t); 0 when |I| <= 1)
  tv_lower  = ½ Σ_{i∈I} |p_s(i) − p_t(i)| + ½ |m_s − m_t|
  tv_upper  = ½ Σ_{i∈I} |p_s(i) − p_t(i)| + ½ (1 − m_s) + ½ (1 − m_t)
The TV bounds hold for the full vocabulary: outside I the two sides' masses are 1 − m_s and 1 − m_t, whose TV
share is at least ½ |m_s − m_t| and at most ½ (1 − m_s) + ½ (1 − m_t).

Why numba: the exponentials are the caller's (numpy's and torch's are vectorised; scalar exp in a loop cost more
than everything else here), but matching the ids of two lists is J² comparisons a position, which as array ops
makes [n, J, J] temporaries (400 bytes a position at J = 20) and ran ~20× slower than the logger's other work.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

# the step sums in the order of schema.TOPK_SUMS: n_topk, then the per-position terms
N_SUMS = 8


@njit(cache=True, nogil=True, error_model="numpy")
def group_sums(s_ids, s_lp, t_ids, t_lp, ps, pt, group, out):  # pragma: no cover - compiled
    """Add schema.TOPK_SUMS of each row i of [n, J] ids, log-probs and their exponentials ps, pt (float64) to
    out[group[i]] ([groups, N_SUMS] float64); rows with group[i] < 0 (padding) are skipped. Ids are distinct
    within a row (checked by the caller)."""
    n, J = s_ids.shape
    for i in range(n):
        g = group[i]
        if g < 0:
            continue
        ms = 0.0
        mt = 0.0
        l1 = 0.0
        n_i = 0
        mass_s = 0.0
        mass_t = 0.0
        best_s, best_t = 0, 0
        for a in range(J):
            mass_s += ps[i, a]
            mass_t += pt[i, a]
            if s_lp[i, a] > s_lp[i, best_s]:
                best_s = a
            if t_lp[i, a] > t_lp[i, best_t]:
                best_t = a
        # the trainer's rank of each sampler id, −1 where it has none: a branch-free scan, which vectorises
        match = np.empty(J, np.int64)
        for a in range(J):
            m = -1
            x = s_ids[i, a]
            for b in range(J):
                m = b if t_ids[i, b] == x else m
            match[a] = m
            if m >= 0:
                n_i += 1
                ms += ps[i, a]
                mt += pt[i, m]
                l1 += abs(ps[i, a] - pt[i, m])
        kl = 0.0
        if n_i >= 2:
            shift = math.log(ms) - math.log(mt)
            for a in range(J):
                m = match[a]
                if m >= 0:
                    kl += (ps[i, a] / ms) * ((np.float64(s_lp[i, a]) - np.float64(t_lp[i, m])) - shift)
        out[g, 0] += 1.0
        out[g, 1] += n_i / J
        out[g, 2] += 1.0 if s_ids[i, best_s] == t_ids[i, best_t] else 0.0
        out[g, 3] += mass_s
        out[g, 4] += mass_t
        out[g, 5] += kl
        out[g, 6] += 0.5 * l1 + 0.5 * abs(ms - mt)
        out[g, 7] += 0.5 * l1 + 0.5 * (1.0 - ms) + 0.5 * (1.0 - mt)


@njit(cache=True, nogil=True, error_model="numpy")
def first_repeat(ids, valid):  # pragma: no cover - compiled
    """The first row i with valid[i] whose [J] ids hold one id twice, else −1."""
    n, J = ids.shape
    for i in range(n):
        if not valid[i]:
            continue
        dup = False
        for a in range(1, J):
            x = ids[i, a]
            for b in range(a):
                dup |= ids[i, b] == x
        if dup:
            return i
    return -1


def topk_sums(s_ids: np.ndarray, s_lp: np.ndarray, t_ids: np.ndarray, t_lp: np.ndarray, group: np.ndarray,
              n_groups: int) -> np.ndarray:
    """[n_groups, N_SUMS] sums of schema.TOPK_SUMS of the rows of [n, J] arrays (ingest's checked rows; log-probs
    fp32 or float64), grouped by `group` (−1: skip)."""
    out = np.zeros((n_groups, N_SUMS))
    ps = np.exp(s_lp.astype(np.float64))
    pt = np.exp(t_lp.astype(np.float64))
    group_sums(s_ids, s_lp, t_ids, t_lp, ps, pt, group, out)
    return out
