"""Full-distribution sums (METRICS.md v3 "Full distribution") of top-J lists on the CPU: one numba pass per rows.

The formulas of the columns `topk_*` and `top1_agree`, for the arrays that ingest reads and for DriftLogger's
tensors on the CPU (its torch twin for accelerators is analysis/record/fulldist.py; tests check both against a
brute-force reference). Per position with the top-J ids and log-probs of both sides: I = S_s ∩ S_t,
p = exp(log-prob), m_s = Σ_{i∈I} p_s(i), m_t likewise, p̂ = p / m over I:
  overlap   = |I| / J
  agree     = 𝟙[argmax of side s = argmax of side t]   (each side's argmax: the first id with its largest log-prob)
  mass_s    = Σ_{i∈S_s} p_s(i),  mass_t = Σ_{i∈S_t} p_t(i)
  kl        = Σ_{i∈I} p̂_s(i) ((ls_i − lt_i) − log(m_s / m_t))   (= KL(p̂_s ‖ p̂_t); 0 when |I| <= 1)
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
_LOW, _HIGH = (1 << 32) - 1, 1 << 32  # routing_pass's table: the trainer's count of an id, and one of the sampler's


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _slot(x):  # pragma: no cover - compiled
    """The slot of id x in a 4096-slot table (multiplicative hashing)."""
    return ((np.uint64(x) * np.uint64(2654435761)) >> np.uint64(20)) & np.uint64(4095)


@njit(cache=True, nogil=True, error_model="numpy")
def _stamp(ids, i, seen, stamp):  # pragma: no cover - compiled
    """Mark the slot of each id of row i with `stamp` (a number no earlier call used, so nothing needs clearing)
    and its rank, as one entry stamp · 2^32 + rank (one load and one store an id, where two tables took two
    of each); returns whether two ids of the row share a slot (then, and only then, they may be equal)."""
    clash = False
    for a in range(ids.shape[1]):
        h = _slot(ids[i, np.uint64(a)])
        clash |= (seen[h] >> 32) == stamp
        seen[h] = (stamp << 32) | a
    return clash


@njit(cache=True, nogil=True, error_model="numpy")
def _repeats(ids, i):  # pragma: no cover - compiled
    """Whether row i of [n, J] ids holds an id twice: the count of equal pairs is J when they are distinct."""
    J = ids.shape[1]
    same = 0
    for a in range(J):
        x = ids[i, a]
        for b in range(J):
            same += ids[i, b] == x
    return same != J


@njit(cache=True, nogil=True, error_model="numpy")
def _off_rank(s_ids, t_ids, i, seen, s_stamp, t_stamp, at, on_a):  # pragma: no cover - compiled
    """group_sums' matching of the trainer's ids of row i that differ from the sampler's id of the same rank,
    against the table where `_stamp` just put the sampler's (distinct, in distinct slots) ids, and at, on_a
    holding the ranks where both sides agree: each such id found among the sampler's (at rank k) sets at[k] and
    on_a[k]. Returns the count found, −1 where such an id repeats a trainer id (one where the sides agree, or
    another of these), −2 where two ids share a slot (the caller then decides by exact comparisons). An id not
    found is entered with t_stamp, so that a repeat of it finds it."""
    found = 0
    for r in range(t_ids.shape[1]):
        b = np.uint64(r)
        y = t_ids[i, b]
        if y == s_ids[i, b]:
            continue
        h = _slot(y)
        e = seen[h]
        k = np.uint64(e & _LOW)
        if (e >> 32) == s_stamp:
            if s_ids[i, k] != y:  # the sampler's id of this slot is another: y is none of the sampler's
                return -2
            if on_a[k] != 0.0:  # the trainer has y at rank k already (the sides agree there, or an earlier id)
                return -1
            at[k] = b
            on_a[k] = 1.0
            found += 1
        elif (e >> 32) == t_stamp:
            return -1 if t_ids[i, k] == y else -2
        else:
            seen[h] = (t_stamp << 32) | r
    return found


@njit(cache=True, nogil=True, error_model="numpy")
def _exact_ranks(s_ids, t_ids, i, at, on_a):  # pragma: no cover - compiled
    """group_sums' matching of row i by exact comparisons (where ids share a slot): at[r] = the trainer's rank of
    the sampler's id of rank r (0 where it has none), on_a[r] = whether it has one; returns their count. A sum
    over the ranks, which vectorises where a search with a break does not."""
    J = s_ids.shape[1]
    n_i = 0
    for r in range(J):
        x = s_ids[i, np.uint64(r)]
        c = 0
        for b in range(J):
            c += (b + 1) * (t_ids[i, b] == x)
        at[r] = np.uint64(c - 1) if c > 0 else np.uint64(0)
        on_a[r] = 1.0 if c > 0 else 0.0
        n_i += c > 0
    return n_i


@njit(cache=True, nogil=True, error_model="numpy")
def trained_floats(s_lp, t_lp, group, ps, pt):  # pragma: no cover - compiled
    """The log-probs of the rows of [n, J] s_lp, t_lp with group >= 0, one after another, widened into the first
    rows of ps, pt (float64); returns their count. group_sums reads their exponentials in this order: the
    caller's exponentials then skip the padding (a quarter of DriftLogger's bench step), and the widening here
    reads only the rows kept, where a torch copy of the chunk read and widened every row (together ~10 ns of
    CPU a trained token less, benchmarks/RESULTS-logger.md)."""
    n, J = s_lp.shape
    k = 0
    for row in range(n):
        if group[row] < 0:
            continue
        for a in range(J):
            ps[k, a] = s_lp[row, a]
            pt[k, a] = t_lp[row, a]
        k += 1
    return k


@njit(cache=True, nogil=True, error_model="numpy")
def group_sums(s_ids, s_lp, t_ids, t_lp, ps, pt, group, out):  # pragma: no cover - compiled
    """Add schema.TOPK_SUMS of each row i of [n, J] ids and log-probs to out[group[i]] ([groups, N_SUMS]
    float64); rows with group[i] < 0 (padding) are skipped. ps, pt (float64): the exponentials of the log-probs
    of the rows not skipped, one after another (`trained_floats`): the k-th such row's in row k. Returns the first
    row that breaks a rule of the lists (−1: none), whose sums are then not to be used: ids distinct and >= 0,
    log-probs finite and <= 0 (checked here, in the pass that reads them anyway, rather than by passes of their
    own over the [n, J] arrays, which cost as much as these sums).

    Matching by rank first: where both sides hold the same id at a rank (most ranks of real lists, whose heads
    agree; in the same pass as the checks), it is shared there, with no table work. The sampler's ids go into a
    4096-slot table (stamp and rank per slot): where they take distinct slots (~95 % of rows at J = 20) they are
    distinct; then only the trainer's ids off their sampler rank are looked up (`_off_rank`: each finds its
    sampler rank, or none, and the trainer's repeats; its other ids are the sampler's, so distinct). A row whose
    ranks all agree needs no lookup. Elsewhere the exact J² comparisons decide (counting equal pairs on every
    row, and matching every pair, cost ~2.5× as much). The sums are added in rank order, so matching by rank
    leaves them the same to the bit (benchmarks/RESULTS-logger.md: the trainer's stamps and the sampler's lookups
    of every id cost ~12 % of this pass more)."""
    n, J = s_ids.shape
    seen = np.zeros(4096, np.int64)  # per slot: stamp · 2^32 + rank (_stamp; stamps < 2n + 3 < 2^31)
    on_a = np.empty(J)  # per sampler rank: 1 where its id is shared, else 0
    diff = np.empty(J)  # per sampler rank: its log-prob less the trainer's of the same id (where shared)
    at = np.zeros(J, np.uint64)  # per sampler rank: the trainer's rank of its id (0 where it has none)
    kept = -1  # the row of ps, pt
    for row in range(n):
        g = group[row]
        if g < 0:
            continue
        kept += 1
        q = np.uint64(kept)
        i = np.uint64(row)  # unsigned indices: numba adds a wrap-around test to each signed one (~6 % of the pass)
        ok = True
        n_i = 0  # shared ids
        for r in range(J):  # the checks, and the ranks where both sides hold the same id
            a = np.uint64(r)
            ok &= ((s_ids[i, a] | t_ids[i, a]) >= 0) & (s_lp[i, a] <= 0) & (t_lp[i, a] <= 0)
            ok &= (s_lp[i, a] > -np.inf) & (t_lp[i, a] > -np.inf)
            same = s_ids[i, a] == t_ids[i, a]
            at[r] = a if same else np.uint64(0)
            on_a[r] = 1.0 if same else 0.0
            n_i += same
        if not ok:
            return row
        s_stamp = 2 * row + 1
        exact = _stamp(s_ids, i, seen, s_stamp)
        if exact and _repeats(s_ids, i):
            return row
        if n_i < J and not exact:
            found = _off_rank(s_ids, t_ids, i, seen, s_stamp, s_stamp + 1, at, on_a)
            if found == -1:
                return row
            exact = found == -2
            n_i += max(found, 0)
        if exact:
            if n_i < J and _repeats(t_ids, i):
                return row
            n_i = _exact_ranks(s_ids, t_ids, i, at, on_a)
        # what follows is free of branches on the data (whether an id is shared is a coin toss in real lists:
        # mispredicted jumps cost more than the arithmetic)
        ms = 0.0
        mt = 0.0
        l1 = 0.0
        mass_s = 0.0
        mass_t = 0.0
        best_s, best_t = 0, 0
        top_s, top_t = s_lp[i, 0], t_lp[i, 0]
        for r in range(J):
            a = np.uint64(r)
            m = at[r]
            on = on_a[r]
            diff[r] = np.float64(s_lp[i, a]) - np.float64(t_lp[i, m])
            p_s, p_t = ps[q, a], pt[q, m]
            ms += on * p_s
            mt += on * p_t
            l1 += on * abs(p_s - p_t)
            mass_s += p_s
            mass_t += pt[q, a]
            up_s = s_lp[i, a] > top_s
            best_s = r if up_s else best_s
            top_s = s_lp[i, a] if up_s else top_s
            up_t = t_lp[i, a] > top_t
            best_t = r if up_t else best_t
            top_t = t_lp[i, a] if up_t else top_t
        kl = 0.0
        if n_i >= 2:
            shift = math.log(ms / mt)
            inv = 1.0 / ms
            for r in range(J):
                kl += (on_a[r] * inv) * ps[q, np.uint64(r)] * (diff[r] - shift)
        out[g, 0] += 1.0
        out[g, 1] += n_i / J
        out[g, 2] += 1.0 if s_ids[i, best_s] == t_ids[i, best_t] else 0.0
        out[g, 3] += mass_s
        out[g, 4] += mass_t
        out[g, 5] += kl
        out[g, 6] += 0.5 * l1 + 0.5 * abs(ms - mt)
        out[g, 7] += 0.5 * l1 + 0.5 * (1.0 - ms) + 0.5 * (1.0 - mt)
    return -1


@njit(cache=True, nogil=True, error_model="numpy")
def _position_status(se, te, sw, tw, i, has_w, cap):  # pragma: no cover - compiled
    """routing_pass's verdict on position i, where one of its ids is outside [0, cap): (1, i) where an id is
    negative or (has_w) a weight is not finite, else (2, its largest id)."""
    L, K = se.shape[1], se.shape[2]
    low = high = 0
    ok = True
    for layer in range(L):
        for a in range(K):
            low = min(low, se[i, layer, a], te[i, layer, a])
            high = max(high, se[i, layer, a], te[i, layer, a])
            if has_w:
                ok &= (abs(sw[i, layer, a]) < np.inf) & (abs(tw[i, layer, a]) < np.inf)
    if low < 0 or not ok:
        return 1, i
    return 2, high


@njit(cache=True, nogil=True, error_model="numpy")
def _multisets(se, te, sw, tw, i, layer, has_w, tally, weight):  # pragma: no cover - compiled
    """(Σ of equal (sampler, trainer) id pairs, whether the multisets differ, Σ_k |w_s(e_k) − w_t(e_k)|) of one
    row where a side repeats an id: a table of each side's count of each id (the trainer's + 2^32 × the
    sampler's) and of the trainer's weights of each id (a repeat's add up), set and cleared here."""
    K = se.shape[2]
    for b in range(K):
        x = te[i, layer, b]
        tally[x] += 1
        if has_w:
            weight[x] += np.float64(tw[i, layer, b])
    common = 0
    d = 0.0
    for a in range(K):
        y = se[i, layer, a]
        v = tally[y]
        common += v & _LOW
        tally[y] = v + _HIGH
        if has_w:
            d += abs(np.float64(sw[i, layer, a]) - weight[y])
    flip = False
    for a in range(K):
        v, u = tally[se[i, layer, a]], tally[te[i, layer, a]]
        flip |= ((v & _LOW) != (v >> 32)) | ((u & _LOW) != (u >> 32))
    for a in range(K):
        tally[se[i, layer, a]] = 0
        tally[te[i, layer, a]] = 0
        weight[te[i, layer, a]] = 0.0
    return common, flip, d


@njit(cache=True, nogil=True, error_model="numpy")
def routing_pass(se, te, sw, tw, valid, lo, hi, has_t, has_w, load_s, load_t, counts, w_sum, w_max,
                 flipped):  # pragma: no cover - compiled
    """DriftLogger's routing summaries of positions [lo, hi) of [N, L, K] expert ids (and weights) on the CPU, the
    torch ops of record/summaries.py `_routing` as one pass: tokens per (layer, expert) into load_s / load_t
    ([L · cap], expert ids below cap); per layer into counts [5, L]: rows whose expert multisets differ (a flip),
    whose first-ranked ids differ, Σ of equal (sampler, trainer) id pairs, tokens whose lowest flipped layer it
    is, rows weighed (both sides' weights, no flip); the weight sums w_sum / w_max [L] of METRICS.md v3
    weight_abs_diff (d = Σ_k |w_s(e_k) − w_t(e_k)|, the trainer's weight of e_k found by id); flipped[i] = the
    token's flipped layers. Positions with valid[i] false are skipped; has_t / has_w false: te / tw unused. The
    four arrays C-contiguous.

    Returns (0, 0) when done; (1, i) at the first trained position i with a negative expert id or (has_w) a
    weight that is not finite, whose sums are then not to be used (checked here, in the pass that reads them
    anyway, rather than by passes of their own over the [N, L, K] arrays); (2, e) where an id e >= cap was met
    (the caller runs again with wider tables).

    Each row's trainer ids mark a table with a number no other row uses (and write their weights to a table of
    the row's weights), and each sampler id reads its mark: where neither side repeats an id (a sampler id
    finding its own row's mark in a second table is a repeat; ingest refuses repeats), the two sets are equal
    when all K sampler ids carry the trainer's mark, and the trainer's weight of each is in the table. Nothing
    is cleared, and an id is range-checked as it is read (one unsigned comparison), where a loop over each row
    first took its ids' min and max: the two cost ~1.3x as much (benchmarks/RESULTS-logger.md). A row that
    repeats an id is counted again by `_multisets`."""
    L, K = se.shape[1], se.shape[2]
    cap = load_s.shape[0] // L
    u_cap = np.uint64(cap)
    se_f, te_f, sw_f, tw_f = se.reshape(-1), te.reshape(-1), sw.reshape(-1), tw.reshape(-1)
    mark_t = np.zeros(cap, np.int64)  # per id: the number of the last (row, layer) whose trainer routed to it
    mark_s = np.zeros(cap, np.int64)  # the same for the sampler
    weight = np.zeros(cap)  # per id: the trainer's weight of it in that (row, layer)
    tally = np.zeros(cap, np.int64)  # _multisets' tables
    summed = np.zeros(cap)
    for i in range(lo, hi):
        if not valid[i]:
            continue
        n_fl = 0
        first = -1
        finite = True
        for layer in range(L):
            # unsigned indices throughout: numba adds a wrap-around test to each signed one (~10 % of the pass)
            base = np.uint64(layer * cap)
            at = np.uint64((i * L + layer) * K)  # the row's first id in the flat arrays
            row = i * L + layer + 1  # > 0: the tables start at 0
            rep = False
            for b in range(K if has_t else 0):
                x = np.uint64(te_f[at + np.uint64(b)])  # a negative id wraps to >= cap
                if x >= u_cap:
                    return _position_status(se, te, sw, tw, i, has_w, cap)
                load_t[base + x] += 1
                rep |= mark_t[x] == row
                mark_t[x] = row
                if has_w:
                    w = np.float64(tw_f[at + np.uint64(b)])
                    finite &= abs(w) < np.inf
                    weight[x] = w
            common = 0
            d = 0.0
            for a in range(K):
                y = np.uint64(se_f[at + np.uint64(a)])
                if y >= u_cap:
                    return _position_status(se, te, sw, tw, i, has_w, cap)
                load_s[base + y] += 1
                if has_t:
                    common += mark_t[y] == row
                    rep |= mark_s[y] == row
                    mark_s[y] = row
                    if has_w:
                        w = np.float64(sw_f[at + np.uint64(a)])
                        finite &= abs(w) < np.inf
                        d += abs(w - weight[y])
            if not has_t:
                continue
            if rep:
                common, flip, d = _multisets(se, te, sw, tw, i, layer, has_w, tally, summed)
            else:
                flip = common != K
            counts[2, layer] += common
            if se_f[at] != te_f[at]:
                counts[1, layer] += 1
            if flip:
                counts[0, layer] += 1
                n_fl += 1
                if first < 0:
                    first = layer
            elif has_w:
                counts[4, layer] += 1
                w_sum[layer] += d
                if d > w_max[layer]:
                    w_max[layer] = d
        if not finite:
            return 1, i
        if has_t:
            flipped[i] = n_fl
            if first >= 0:
                counts[3, first] += 1
    return 0, 0


def topk_sums(s_ids: np.ndarray, s_lp: np.ndarray, t_ids: np.ndarray, t_lp: np.ndarray, group: np.ndarray,
              n_groups: int) -> np.ndarray:
    """[n_groups, N_SUMS] sums of schema.TOPK_SUMS of the rows of [n, J] arrays (ingest's checked rows; log-probs
    fp32 or float64), grouped by `group` (−1: skip)."""
    out = np.zeros((n_groups, N_SUMS))
    ps, pt = np.empty(s_lp.shape), np.empty(t_lp.shape)
    k = trained_floats(s_lp, t_lp, group, ps, pt)
    np.exp(ps[:k], out=ps[:k])
    np.exp(pt[:k], out=pt[:k])
    if group_sums(s_ids, s_lp, t_ids, t_lp, ps, pt, group, out) >= 0:
        raise ValueError("top-k ids repeat within a row, or a log-prob is not finite and <= 0 (the caller checks "
                         "them first)")
    return out
