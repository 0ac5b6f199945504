"""The per-row work of a routing batch in compiled loops (numba): set masks and the id checks, the set
comparisons of the two sides, the expert-load counts, and the sampler's ids packed into one integer per row.

The numpy versions of these (still the fallback for expert ids of 64 and above, which do not fit a 64-bit
mask) made a dozen passes and temporaries of [rows, k] per batch; with these loops a routing batch of 491,520
(token, layer) rows, top-8, is checked and counted in ~85 ms instead of ~135 ms (normalise + expert_load +
routing_tokens, cProfile; benchmarks/RESULTS-scale.md). Each function is one loop over the rows, writes into
arrays its caller allocates, and releases the GIL, so the prefetch thread that calls it runs beside DuckDB's
insert.

Expert ids are a [n, k] integer matrix (a zero-copy view of the Arrow list values); row i of T is row
rows[i] of S.
"""
from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, nogil=True)
def _popcount(x):
    """The number of bits set in the uint64 x (no branch, so that a loop over rows vectorises)."""
    x = x - ((x >> np.uint64(1)) & np.uint64(0x5555555555555555))
    x = (x & np.uint64(0x3333333333333333)) + ((x >> np.uint64(2)) & np.uint64(0x3333333333333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return (x * np.uint64(0x0101010101010101)) >> np.uint64(56)


@njit(cache=True, nogil=True)
def set_masks(M):
    """(masks, first_negative, first_repeat, max_id) of the expert ids M [n, k].

    masks[i] has bit e set for each id e < 64 of row i; first_negative / first_repeat are the first row with a
    negative id / with an id listed twice (-1: none). first_repeat only counts ids < 64: where max_id >= 64
    the caller checks repeats otherwise.

    Where every id is in [0, 64) (the usual case) the masks come from a loop without branches, and a row repeats
    an id exactly when its mask has fewer than k bits: 0.9 instead of 2.1 ns an id. Otherwise the ids are
    checked one by one (`_set_masks_each`)."""
    n, k = M.shape
    masks = np.empty(n, np.uint64)
    lo, hi = np.int64(0), np.int64(-1)
    one = np.uint64(1)
    for i in range(n):
        m = np.uint64(0)
        for c in range(k):
            e = np.int64(M[i, c])
            lo = min(lo, e)
            hi = max(hi, e)
            m |= one << np.uint64(e & 63)
        masks[i] = m
    if lo < 0 or hi >= 64:
        return _set_masks_each(M)
    rep = -1
    for i in range(n):
        if _popcount(masks[i]) != k:
            rep = i
            break
    return masks, -1, rep, hi


@njit(cache=True, nogil=True)
def _set_masks_each(M):
    """set_masks, id by id (any ids)."""
    n, k = M.shape
    masks = np.zeros(n, np.uint64)
    neg, rep, hi = -1, -1, -1
    one = np.uint64(1)
    for i in range(n):
        m = np.uint64(0)
        for c in range(k):
            e = np.int64(M[i, c])
            if e > hi:
                hi = e
            if e < 0:
                if neg < 0:
                    neg = i
            elif e < 64:
                b = one << np.uint64(e)
                if (m & b) and rep < 0:
                    rep = i
                m |= b
        masks[i] = m
    return masks, neg, rep, hi


@njit(cache=True, nogil=True)
def compare(S, T, rows, s_mask, t_mask, flip, top1, common, same):
    """For each row j of T (row rows[j] of S): whether the sets differ, the first-ranked experts differ,
    how many experts both list (popcount of the AND of the masks), and whether the lists are equal rank for
    rank; written at rows[j] of flip, top1, common, same."""
    k = S.shape[1]
    for j in range(len(rows)):
        i = rows[j]
        a, b = s_mask[i], t_mask[j]
        flip[i] = a != b
        common[i] = _popcount(a & b)
        top1[i] = S[i, 0] != T[j, 0]
        eq = True
        for c in range(k):
            if S[i, c] != T[j, c]:
                eq = False
                break
        same[i] = eq


@njit(cache=True, nogil=True)
def count_experts(base, M, out):
    """out[base[i] + M[i, c]] += 1 for every id of every row (base: the row's (run, step, layer) cell times
    the number of experts)."""
    for i in range(M.shape[0]):
        b = base[i]
        for c in range(M.shape[1]):
            out[b + M[i, c]] += 1


@njit(cache=True, nogil=True)
def pack(M, bits, out):
    """out[i] = Σ_c M[i, c] << (c · bits): row i's ids in rank order, `bits` bits each (the caller checked that
    every id is below 2^bits and that k · bits <= 64)."""
    for i in range(M.shape[0]):
        p = np.uint64(0)
        for c in range(M.shape[1]):
            p |= np.uint64(M[i, c]) << np.uint64(c * bits)
        out[i] = p
