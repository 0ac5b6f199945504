"""The summary rows of a set of tokens in ONE pass over them: a numba kernel, for CPU writers.

The rows are those of summary_seq, summary_seq_band, summary_step, summary_hist, summary_bucket and
summary_bucket_band (schema.py), with the per-token terms of compute.py. DriftLogger calls it when a step's
tensors are on the CPU (analysis/record/summaries.py); the torch reduction stays for other devices.

Input, long format (one entry per token, any order): the layout of a `tokens` Arrow batch, so that ingest
could call `Accumulators.add` on its batches' columns as they come (`to_numpy()` of float64 s, t; int pos; a
dense sequence index per token from the batch's sample column; lag with −1 for a null version; entropy with
NaN for a null), and merge batches by adding into the same accumulators. Ingest does so
(analysis/ingest/summary_stream.py); compute.py's SQL stays for the files it hands back. The sequence × band cells
take 3 KB per sequence, so such a caller bounds the sequences per set of accumulators (one step's sequences, as
here).

  s, t      float64 [n] sampler / trainer log-probs (finite, ≤ 0: checked by the caller)
  pos       int64 [n] position in the sequence
  seq       int64 [n] dense sequence index in [0, n_seq): the row of the sequence accumulators
  valid     bool [n] or empty: which tokens count (empty: all)
  seq_lag   int64 [n_seq] or empty: one lag (trainer − sampler version, offset so the smallest is 0) per
            sequence; −1: none
  tok_lag   int64 [n] or empty: the same per token (used when seq_lag is empty)
  entropy   float64 [n] or empty: sampler entropy (NaN: none)
  flipped   int64 [n] or empty: the token's number of flipped MoE layers; −1: no trainer routing for it

or "grid" form, DriftLogger's [B, T] tensors flattened row-major with no copy: pos and seq empty, and a
token i is at sequence i // T, position i % T; `valid` is the mask.

Output: accumulators the caller allocates (`Accumulators`), so that two calls on disjoint token ranges (two
threads, or successive Arrow batches) merge by addition and max. Every sum is compensated: plain partial
sums of at most RUN tokens, added into a running sum by Neumaier's rule (the sum and its rounding error,
read as sum + error), so a sum over millions of tokens stays within a few ulps of the exact sum, as DuckDB's
fsum does, whatever the order; the kernel's sums and the SQL's then differ by the few ulps of each per-token
term (see `accumulate`). Counts are float64 (exact below 2^53) in column 0, as in the torch writer.

How a call is laid out, per chunk of CHUNK tokens (measured on 750k tokens: benchmarks/RESULTS-kernel.md):
  - numpy's vectorised exp and expm1 of the chunk (SIMD: ~10x faster than libm's per token in the loop);
  - a loop for each token's Δ bin and probability bucket;
  - per block of SUB tokens, a loop that writes each token's terms into a column of W (sums) and XK (the
    extremes' order keys). It has no branch, scatter or exception (error_model="numpy": a division by zero
    gives inf rather than raising) and its rows lie at constant distances, so LLVM vectorises it; the rows are
    SUB_STRIDE apart, not a power of two, which kept 27 store streams from evicting each other in L1
    (74 -> 14 ns a token, measured);
  - then run by run: a "run" is consecutive tokens of one sequence and position bucket, at most RUN of them
    (in DriftLogger's row-major layout, a stretch of a row). Its sums and maxima are reduced over its columns
    (vectorised: sums reassociated within the run, maxima as integer keys, since LLVM does not vectorise a
    float maximum), then added once into its sequence, the step, its position bucket and its lag bucket
    (the sequence's lag, or the one lag its tokens share). The block's most common probability bucket is
    reduced in the same pass, from the tokens of the run that fall in it;
  - then each token of the run joins, on its own, its Δ bin, band cells, probability bucket (if not the
    common one) and, when given, per-token lag (where a run's tokens differ), entropy bucket and flip sums.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from analysis.summaries import schema as S

# Columns of the wide accumulators: the band tables' three (count, Σ r − 1, Σ (r − 1)²), then the other sums.
NARROW = list(S.BAND_SUM_NAMES)
WIDE = NARROW + [c.name for c in S.TOKEN_SUMS if c.name.startswith("sum_") and c.name not in NARROW]
# Columns of the extremes, each a value whose maximum is wanted (a minimum is stored negated, which is exact);
# max_abs_d is max(max_d, −min_d).
EXTREMES = ["max_d", "min_d", "max_adp", "max_s", "min_s", "max_t", "min_t"]
DERIVED = "max_abs_d"
assert set(WIDE) | set(EXTREMES) | {DERIVED} == {c.name for c in S.TOKEN_SUMS}
NW, NX, NB = len(WIDE), len(EXTREMES), S.N_BANDS
# the kernel writes its terms by these column numbers (compile-time constants)
I_RM1, I_RM1_SQ, I_D, I_D2, I_ABS_D, I_K3, I_K3R, I_MPE, I_ADP, I_QS, I_QT, I_QS2, I_QT2, I_QSQT, I_PS, I_PT, \
    I_PS2, I_PT2, I_PSPT = (WIDE.index(c) for c in (
        "sum_rm1", "sum_rm1_sq", "sum_d", "sum_d2", "sum_abs_d", "sum_k3", "sum_k3r", "sum_mpe", "sum_adp", "sum_qs",
        "sum_qt", "sum_qs2", "sum_qt2", "sum_qsqt", "sum_ps", "sum_pt", "sum_ps2", "sum_pt2", "sum_pspt"))
X_MAX_D, X_MIN_D, X_MAX_ADP, X_MAX_S, X_MIN_S, X_MAX_T, X_MIN_T = range(NX)

# Rows of the wide group accumulator: the step, then each bucket dimension's buckets.
N_POS = 64  # position buckets: the bit length of an int64 position
N_ENT = len(S.ENTROPY_EDGES)
STEP, PROB0 = 0, 1
POS0 = PROB0 + S.PROB_BINS
ENT0 = POS0 + N_POS
LAG0 = ENT0 + N_ENT  # lag buckets follow: LAG0 + lag − lo
DIMS = {"prob": (PROB0, S.PROB_BINS), "position": (POS0, N_POS), "entropy": (ENT0, N_ENT)}  # (first row, rows)
FLIPS = ("n_any_flip", "sum_flipped_layers", "sum_abs_d_flip", "sum_k3_flip", "sum_abs_d_noflip", "sum_k3_noflip")
RUN = 256  # at most this many tokens summed plainly before a compensated add (error ≤ RUN·eps relative)
LN10 = math.log(10.0)  # DuckDB's ln(10), the same double
CLAMP, SERIES_BELOW = float(S.CLAMP), float(S.SERIES_BELOW)
PROB_LO, PROB_WIDTH, PROB_TOP = float(S.PROB_LO), float(S.PROB_WIDTH), S.PROB_BINS - 1


def _edges(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)


D_EDGES, BAND_EDGES, ENTROPY_EDGES = _edges(S.D_EDGES), _edges(S.BAND_EDGES), _edges(S.ENTROPY_EDGES)
D_PADDED = np.concatenate([D_EDGES, np.full(512 - len(D_EDGES), np.inf)])  # for _count_below


def bin_ids(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The schema's bin id 2·#{E < x} + 𝟙[x on an edge] of each x (numpy, for tables and tests)."""
    below = np.searchsorted(edges, x, side="left")
    on_edge = edges[np.minimum(below, len(edges) - 1)] == x
    return 2 * below + on_edge


def _band_of_bin() -> np.ndarray:
    """The band (on BAND_EDGES) of each fine Δ bin (on D_EDGES): one per bin, since BAND_EDGES ⊂ D_EDGES."""
    e = S.D_EDGES
    inside = [e[0] - 1.0] + [(a + b) / 2 for a, b in zip(e, e[1:])] + [e[-1] + 1.0]  # a point of each open bin
    points = [v for k in range(len(e)) for v in (inside[k], e[k])] + [inside[-1]]  # bin 2k, then edge 2k + 1
    return bin_ids(np.array(points), BAND_EDGES).astype(np.int64)


BAND_OF_BIN = _band_of_bin()


def _bin_start() -> np.ndarray:
    """For each value k of a float64's top 16 bits (sign, exponent, 4 bits of mantissa): #{E < x} of the
    smallest x with those bits. At most 3 edges of D_EDGES lie between two such x."""
    keys = np.arange(1 << 16, dtype=np.uint64) << np.uint64(48)
    low = np.uint64((1 << 48) - 1)
    negative = keys >= np.uint64(1 << 63)  # the smallest negative value of a range is the one with most bits
    smallest = np.where(negative, keys | low, keys).view(np.float64)
    start = np.searchsorted(D_EDGES, np.nan_to_num(smallest, nan=0.0), side="left")
    return start.astype(np.int64)


BIN_START = _bin_start()


# -- the kernel ----------------------------------------------------------------------------------------
# Helpers are compiled into their callers by LLVM (`forceinline`: the always-inline attribute) rather than by
# numba's own IR inlining (`inline="always"`): the same machine code speed (bench_kernel.py: 1.01-1.03x), and a
# first call that compiles the kernel took 6.1 s instead of 9.8 s (benchmarks/RESULTS-kernel.md). error_model as
# the kernel's: a division by zero gives inf.
_inlined = njit(forceinline=True, error_model="numpy")

# Accumulator arrays are [planes, rows, columns]: plane 0 a compensated sum, plane 1 its rounding error
# (the value is their sum), and, for groupings a token joins on its own (probability bucket, band cells, ...),
# plane 2 a plain partial sum of at most RUN tokens, added into planes 0–1 when its count (column 0) reaches
# RUN and at the end of every call.

@_inlined
def _add(acc, row, col, x):
    """Neumaier's compensated add of x into acc[0, row, col], its rounding error into acc[1, row, col]."""
    s = acc[0, row, col]
    u = s + x
    if abs(s) >= abs(x):
        acc[1, row, col] += (s - u) + x
    else:
        acc[1, row, col] += (x - u) + s
    acc[0, row, col] = u


@_inlined
def _settle(acc, row):
    """Add the plain partial sums of `row` (plane 2) into its compensated sums and clear them."""
    for j in range(acc.shape[2]):
        _add(acc, row, j, acc[2, row, j])
        acc[2, row, j] = 0.0


@_inlined
def _settle_rows(acc, lo, hi):
    for row in range(lo, hi):
        if acc[2, row, 0] > 0:
            _settle(acc, row)


@_inlined
def _pend_band(acc, row, rm1, rm1_sq):
    """A token's (1, r − 1, (r − 1)²) into the plain partial sums of a band cell."""
    acc[2, row, 0] += 1.0
    acc[2, row, 1] += rm1
    acc[2, row, 2] += rm1_sq
    if acc[2, row, 0] >= RUN:
        _settle(acc, row)


@_inlined
def _series_k3(x):
    """e^x − 1 − x by compute.series_k3_sql's Horner form, the same operations in the same order."""
    inner = 1.0 / 40320
    inner = 1.0 / 5040 + x * inner
    inner = 1.0 / 720 + x * inner
    inner = 1.0 / 120 + x * inner
    inner = 1.0 / 24 + x * inner
    inner = 1.0 / 6 + x * inner
    inner = 1.0 / 2 + x * inner
    return x * x * inner


@_inlined
def _d_bin(d, d_bits, bin_start, d_padded):
    """The fine Δ bin of d (its float64 bits d_bits): the edges below the smallest value sharing d's top 16
    bits, from a table, then the at most 3 edges within that range, without branches (so that the loop over
    a chunk vectorises; a binary search, a mispredicted branch per step, measured 4x slower)."""
    c = bin_start[(d_bits >> 48) & 0xFFFF]
    c += d_padded[c] < d
    c += d_padded[c] < d
    c += d_padded[c] < d
    return 2 * c + (d_padded[c] == d)


@_inlined
def _bit_length(p):
    k = 0
    while p > 0:
        p >>= 1
        k += 1
    return k


CHUNK = 1 << 15  # tokens whose exp / expm1 are computed at once (numpy's vectorised functions; in L2)
SUB = 2048  # tokens whose terms are held at once (W, XK: 440 KB)
SUB_STRIDE = SUB + 24  # their rows' distance: rows 16 KB apart would share the L1 cache's sets
KEY_MASK = np.int64((1 << 63) - 1)
KEY_NEG_INF = np.int64(np.float64(-np.inf).view(np.int64) ^ ((1 << 63) - 1))  # _key(−inf)


@njit(fastmath={"reassoc", "nsz"}, error_model="numpy", nogil=True, cache=True)
def _run_sums(W, off, key, key_off, n, want, out):
    """out[0, j], out[1, j]: Σ W[j·SUB_STRIDE + off + c] over c < n, and the same where key[key_off + c] == want,
    for every column j of WIDE (vectorised over c, reassociated within the run: a plain sum of ≤ RUN terms)."""
    keys = key[key_off:key_off + n]
    for j in range(NW):
        row = W[j * SUB_STRIDE + off:j * SUB_STRIDE + off + n]
        acc = 0.0
        part = 0.0
        for c in range(n):
            x = row[c]
            acc += x
            part += x if keys[c] == want else 0.0
        out[0, j] = acc
        out[1, j] = part


@njit(error_model="numpy", nogil=True, cache=True)
def _run_maxima(XK, off, key, key_off, n, want, out):
    """out[0, j], out[1, j]: the largest order key of extreme j over c < n, and over those where
    key[key_off + c] == want (an integer maximum vectorises where a float one does not)."""
    keys = key[key_off:key_off + n]
    for j in range(NX):
        row = XK[j * SUB_STRIDE + off:j * SUB_STRIDE + off + n]
        m = KEY_NEG_INF
        mp = KEY_NEG_INF
        for c in range(n):
            x = row[c]
            m = x if x > m else m
            y = x if keys[c] == want else KEY_NEG_INF
            mp = y if y > mp else mp
        out[0, j] = m
        out[1, j] = mp


@_inlined
def _key(x):
    """An int64 that orders as the float64 x does (no NaN): its bits, the lower 63 flipped if negative."""
    b = np.float64(x).view(np.int64)
    return b ^ ((b >> 63) & KEY_MASK)


@_inlined
def _unkey(k):
    """The float64 of an order key (`_key` is its own inverse on the bits)."""
    return np.int64(k ^ ((k >> 63) & KEY_MASK)).view(np.float64)


@_inlined
def _terms(s, t, E, valid, masked, n, W, XK):
    """The terms of n tokens: token c's sums into W[j·SUB_STRIDE + c] (j a column of WIDE), its extremes' order
    keys into XK[j·SUB_STRIDE + c] (j of EXTREMES); 0 and −inf where `valid` is False. s, t, valid start at the
    first token, E (the chunk's numpy rows, CHUNK apart) at its column. No branch, scatter or exception in the
    loop, and constant distances between rows, so that it vectorises."""
    for c in range(n):
        ok = not masked or valid[c]
        si, ti = s[c], t[c]
        d = E[c]  # t − s
        cd = d if d > -CLAMP else -CLAMP
        cd = cd if cd < CLAMP else CLAMP
        rm1 = E[CHUNK + c]
        em = -rm1 / E[2 * CHUNK + c]
        ps, pt = E[3 * CHUNK + c], E[5 * CHUNK + c]
        qs = -E[4 * CHUNK + c]
        ad = abs(d)
        k3_big, k3r_big = rm1 - d, em + d
        k3_big = k3_big if k3_big > 0.0 else 0.0
        k3r_big = k3r_big if k3r_big > 0.0 else 0.0
        k3_series, k3r_series = _series_k3(d), _series_k3(-d)
        small = ad < SERIES_BELOW
        k3 = k3_series if small else k3_big
        k3r = k3r_series if small else k3r_big
        dp_exact, dp_clamped = ps * rm1, pt - ps
        dp = dp_exact if d == cd else dp_clamped
        qt = qs - dp
        adp = abs(dp)
        mpe = rm1 if cd >= 0 else em
        W[c] = 1.0 if ok else 0.0
        W[I_RM1 * SUB_STRIDE + c] = rm1 if ok else 0.0
        W[I_RM1_SQ * SUB_STRIDE + c] = rm1 * rm1 if ok else 0.0
        W[I_D * SUB_STRIDE + c] = d if ok else 0.0
        W[I_D2 * SUB_STRIDE + c] = d * d if ok else 0.0
        W[I_ABS_D * SUB_STRIDE + c] = ad if ok else 0.0
        W[I_K3 * SUB_STRIDE + c] = k3 if ok else 0.0
        W[I_K3R * SUB_STRIDE + c] = k3r if ok else 0.0
        W[I_MPE * SUB_STRIDE + c] = mpe if ok else 0.0
        W[I_ADP * SUB_STRIDE + c] = adp if ok else 0.0
        W[I_QS * SUB_STRIDE + c] = qs if ok else 0.0
        W[I_QT * SUB_STRIDE + c] = qt if ok else 0.0
        W[I_QS2 * SUB_STRIDE + c] = qs * qs if ok else 0.0
        W[I_QT2 * SUB_STRIDE + c] = qt * qt if ok else 0.0
        W[I_QSQT * SUB_STRIDE + c] = qs * qt if ok else 0.0
        W[I_PS * SUB_STRIDE + c] = ps if ok else 0.0
        W[I_PT * SUB_STRIDE + c] = pt if ok else 0.0
        W[I_PS2 * SUB_STRIDE + c] = ps * ps if ok else 0.0
        W[I_PT2 * SUB_STRIDE + c] = pt * pt if ok else 0.0
        W[I_PSPT * SUB_STRIDE + c] = ps * pt if ok else 0.0
        XK[X_MAX_D * SUB_STRIDE + c] = _key(d) if ok else KEY_NEG_INF
        XK[X_MIN_D * SUB_STRIDE + c] = _key(-d) if ok else KEY_NEG_INF
        XK[X_MAX_ADP * SUB_STRIDE + c] = _key(adp) if ok else KEY_NEG_INF
        XK[X_MAX_S * SUB_STRIDE + c] = _key(si) if ok else KEY_NEG_INF
        XK[X_MIN_S * SUB_STRIDE + c] = _key(-si) if ok else KEY_NEG_INF
        XK[X_MAX_T * SUB_STRIDE + c] = _key(ti) if ok else KEY_NEG_INF
        XK[X_MIN_T * SUB_STRIDE + c] = _key(-ti) if ok else KEY_NEG_INF


@_inlined
def _pend_token(acc, topk, row, W, XK, c):
    """Token c's terms into the plain partial sums of a wide `row`, its extremes' keys into topk[row]."""
    for j in range(NW):
        acc[2, row, j] += W[j * SUB_STRIDE + c]
    for j in range(NX):
        x = XK[j * SUB_STRIDE + c]
        if x > topk[row, j]:
            topk[row, j] = x
    if acc[2, row, 0] >= RUN:
        _settle(acc, row)


@njit(cache=True, nogil=True, error_model="numpy")
def accumulate(s, t, E, bin_a, prob_a, W, XK, pos, seq, valid, T, lo, hi, seq_lag, tok_lag, entropy, flipped,
               d_padded, bin_start, band_of_bin, ent_edges,
               seq_acc, seq_top, seq_max_pos, seq_flip, seq_band, wide, wide_top, band, hist, flip):
    """Add tokens lo .. hi − 1 (at most CHUNK) to the accumulators (the module docstring lists the inputs,
    `Accumulators` the outputs). E holds, CHUNK apart, the rows t − s, expm1(cd), exp(cd), exp(s), expm1(s),
    exp(t) of those tokens (numpy's vectorised functions, `Accumulators.add`); bin_a and prob_a take their Δ bin
    and probability-bucket row; W and XK the terms of SUB tokens at a time.

    The per-token terms are compute.token_terms_sql's, from those five: the SQL forms expm1 from exp by
    Kahan's (u − 1)·x / ln u, accurate to a few ulps, and numpy's exp and expm1 are within a few ulps too, so
    the two agree per term to a few ulps, which the compensated sums then preserve. The k3 series is the
    SQL's Horner form, operation for operation.
    """
    n_all = hi - lo
    d_a = E[:n_all]
    d_bits = d_a.view(np.int64)
    for k in range(n_all):  # vectorised: each token's Δ bin and probability bucket
        bin_a[k] = _d_bin(d_a[k], d_bits[k], bin_start, d_padded)
        prob_a[k] = PROB0 + int(min(max(math.floor((s[lo + k] / LN10 - PROB_LO) / PROB_WIDTH), 0.0), PROB_TOP))
    grid = len(seq) == 0
    masked = len(valid) > 0
    has_seq_lag, has_tok_lag = len(seq_lag) > 0, len(tok_lag) > 0
    has_ent, has_flip = len(entropy) > 0, len(flipped) > 0
    topk = np.full((wide.shape[1], NX), KEY_NEG_INF)  # per-token groupings' maxima, as order keys
    run_band = np.zeros((NB, 3))  # a run's band cells, those touched listed in run_bands[:n_bands]
    run_bands = np.empty(NB, np.int64)
    counts = np.zeros(S.PROB_BINS, np.int64)
    sums = np.empty((2, NW))  # a run's sums, and those of its tokens in the common probability bucket
    maxima = np.empty((2, NX), np.int64)  # the same for the extremes' order keys
    for a in range(0, n_all, SUB):
        b = min(n_all, a + SUB)
        _terms(s[lo + a:], t[lo + a:], E[a:], valid[lo + a:] if masked else valid, masked, b - a, W, XK)
        # the block's most common probability bucket (from every 4th token): its tokens join it run by run,
        # in the vectorised sums below, rather than one by one
        counts[:] = 0
        for k in range(a, b, 4):
            if not masked or valid[lo + k]:
                counts[prob_a[k] - PROB0] += 1
        dom = PROB0 + np.argmax(counts)
        k = a
        while k < b:
            i = lo + k
            if masked and not valid[i]:
                k += 1
                continue
            if grid:
                sq = i // T
                p = i - sq * T
            else:
                sq = seq[i]
                p = pos[i]
            pb = _bit_length(p)
            p_lo = 0 if pb == 0 else 1 << (pb - 1)
            p_hi = 1 << pb
            limit = min(b, k + RUN)
            # the run: tokens k .. e − 1 of one sequence and position bucket (masked ones inside hold 0, −inf)
            max_pos = p
            if grid:
                e = min(limit, sq * T + min(p_hi, T) - lo)
                last = e - 1
                while masked and not valid[lo + last]:
                    last -= 1
                max_pos = lo + last - sq * T
            else:
                e = k + 1
                while e < limit:
                    j = lo + e
                    if not masked or valid[j]:
                        pj = pos[j]
                        if seq[j] != sq or pj < p_lo or pj >= p_hi:
                            break
                        max_pos = max(max_pos, pj)
                    e += 1
            # its lag bucket: the sequence's, or the one its tokens share (else each token's, below)
            lag_g = -1
            per_token_lag = False
            if has_seq_lag:
                if seq_lag[sq] >= 0:
                    lag_g = LAG0 + seq_lag[sq]
            elif has_tok_lag:
                first = tok_lag[i]
                for j in range(i + 1, lo + e):
                    if tok_lag[j] != first and (not masked or valid[j]):
                        per_token_lag = True
                        break
                if not per_token_lag and first >= 0:
                    lag_g = LAG0 + first
            pos_g = POS0 + pb
            ca, m = k - a, e - k
            _run_sums(W, ca, prob_a, k, m, dom, sums)
            _run_maxima(XK, ca, prob_a, k, m, dom, maxima)
            for j in range(NW):
                x, xd = sums[0, j], sums[1, j]
                _add(seq_acc, sq, j, x)
                _add(wide, STEP, j, x)
                _add(wide, pos_g, j, x)
                if lag_g >= 0:
                    _add(wide, lag_g, j, x)
                _add(wide, dom, j, xd)  # 0 if the run has none of it
            for j in range(NX):
                xk, xdk = maxima[0, j], maxima[1, j]
                x = _unkey(xk)
                seq_top[sq, j] = max(seq_top[sq, j], x)
                wide_top[STEP, j] = max(wide_top[STEP, j], x)
                wide_top[pos_g, j] = max(wide_top[pos_g, j], x)
                if lag_g >= 0:
                    wide_top[lag_g, j] = max(wide_top[lag_g, j], x)
                topk[dom, j] = max(topk[dom, j], xdk)
            seq_max_pos[sq] = max(seq_max_pos[sq], max_pos)

            # each token of the run on its own: probability bucket, Δ bin, band cells, per-token groupings
            n_bands = 0
            for kk in range(k, e):
                ii = lo + kk
                if masked and not valid[ii]:
                    continue
                c = kk - a
                rm1 = W[I_RM1 * SUB_STRIDE + c]
                rm1_sq = W[I_RM1_SQ * SUB_STRIDE + c]
                dbin = bin_a[kk]
                bd = band_of_bin[dbin]
                _pend_band(hist, dbin, rm1, rm1_sq)
                if run_band[bd, 0] == 0:
                    run_bands[n_bands] = bd
                    n_bands += 1
                run_band[bd, 0] += 1.0
                run_band[bd, 1] += rm1
                run_band[bd, 2] += rm1_sq
                pr = prob_a[kk]
                if pr != dom:
                    _pend_token(wide, topk, pr, W, XK, c)
                _pend_band(band, pr * NB + bd, rm1, rm1_sq)
                if per_token_lag and tok_lag[ii] >= 0:
                    g = LAG0 + tok_lag[ii]
                    _pend_token(wide, topk, g, W, XK, c)
                    _pend_band(band, g * NB + bd, rm1, rm1_sq)
                if has_ent and entropy[ii] == entropy[ii]:  # NaN: no entropy
                    en = entropy[ii]
                    g = ENT0
                    while g + 1 < ENT0 + len(ent_edges) and en >= ent_edges[g + 1 - ENT0]:
                        g += 1
                    _pend_token(wide, topk, g, W, XK, c)
                    _pend_band(band, g * NB + bd, rm1, rm1_sq)
                if has_flip and flipped[ii] >= 0:  # a token with routing of both sides
                    fl = flipped[ii]
                    flip[0, 0, 6] += 1.0  # n_routed
                    if fl > 0:
                        seq_flip[sq] += 1
                        flip[0, 0, 0] += 1.0
                        flip[0, 0, 1] += fl
                        _add(flip, 0, 2, W[I_ABS_D * SUB_STRIDE + c])
                        _add(flip, 0, 3, W[I_K3 * SUB_STRIDE + c])
                    else:
                        _add(flip, 0, 4, W[I_ABS_D * SUB_STRIDE + c])
                        _add(flip, 0, 5, W[I_K3 * SUB_STRIDE + c])
            for mb in range(n_bands):  # the run's band cells into the sequence's, the position's, the lag's
                bd = run_bands[mb]
                for j in range(3):
                    x = run_band[bd, j]
                    _add(seq_band, sq * NB + bd, j, x)
                    _add(band, pos_g * NB + bd, j, x)
                    if lag_g >= 0:
                        _add(band, lag_g * NB + bd, j, x)
                    run_band[bd, j] = 0.0
            k = e
    for row in range(topk.shape[0]):
        for j in range(NX):
            if topk[row, j] > KEY_NEG_INF:
                wide_top[row, j] = max(wide_top[row, j], _unkey(topk[row, j]))
    _settle_rows(wide, 0, wide.shape[1])
    _settle_rows(band, 0, band.shape[1])
    _settle_rows(hist, 0, hist.shape[1])


def read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of a: the kernels' inputs are all passed so, ingest's zero-copy Arrow views (read-only) and
    DriftLogger's torch arrays (writable) alike, so that numba compiles one signature for both, not one each."""
    v = a.view()
    v.flags.writeable = False
    return v


SEQUENCE_FIELDS = ("seq", "seq_top", "seq_max_pos", "seq_flip", "seq_band")  # one row (or NB rows) per sequence


@dataclass
class Accumulators:
    """What `accumulate` adds into, for n_seq sequences and n_lag lags; merge two by `merge`.
    [planes, rows, cols] arrays hold compensated sums (see "the kernel" above)."""
    seq: np.ndarray  # [2, n_seq, NW]
    seq_top: np.ndarray  # [n_seq, NX], −inf where empty
    seq_max_pos: np.ndarray  # [n_seq] int64, −1 where empty
    seq_flip: np.ndarray  # [n_seq] int64: tokens with a flip at some layer
    seq_band: np.ndarray  # [2, n_seq·NB, 3]: (sequence, band) cells
    wide: np.ndarray  # [3, LAG0 + n_lag, NW]: step, prob, position, entropy, lag rows
    wide_top: np.ndarray  # [LAG0 + n_lag, NX]
    band: np.ndarray  # [3, (LAG0 + n_lag)·NB, 3]: (bucket, band) cells (the step's unused)
    hist: np.ndarray  # [3, N_BINS, 3]
    flip: np.ndarray  # [2, 1, 7]: FLIPS, then n_routed

    @staticmethod
    def zeros(n_seq: int, n_lag: int = 0) -> "Accumulators":
        rows = LAG0 + n_lag
        return Accumulators(np.zeros((2, n_seq, NW)), np.full((n_seq, NX), -np.inf), np.full(n_seq, -1, np.int64),
                            np.zeros(n_seq, np.int64), np.zeros((2, n_seq * NB, 3)), np.zeros((3, rows, NW)),
                            np.full((rows, NX), -np.inf), np.zeros((3, rows * NB, 3)), np.zeros((3, S.N_BINS, 3)),
                            np.zeros((2, 1, len(FLIPS) + 1)))

    def add(self, s, t, pos=None, seq=None, valid=None, T: int = 0, lo: int = 0, hi: int | None = None,
            seq_lag=None, tok_lag=None, entropy=None, flipped=None, seq_sums_out=None) -> "Accumulators":
        """Add tokens lo .. hi − 1 (see the module docstring; None: absent; pos and seq None: grid form).

        `seq_sums_out`: a [5, n_seq] float64 array into which each token's per-sequence log-prob terms are added
        (`_seq_sums`: count, Σ s, Σ t, Σ log cosh(Δ/2), Σ r·t, r = exp(clamp(Δ, ±20))), from the chunk's Δ and r
        computed here anyway, while its s and t are in the cache: ingest's stream, where a pass of their own over
        the batch cost ~2x as much, and DriftLogger (grid form: a token's sequence is its row), where a scalar
        pass of their own cost ~11 % of a step with top-k lists. Each term is the same value whatever the chunk
        and the sums take the tokens in order, so they equal one pass over the tokens to the bit."""
        def arr(a, dtype):
            return read_only(np.empty(0, dtype) if a is None else np.ascontiguousarray(a, dtype))
        s, t = arr(s, np.float64), arr(t, np.float64)
        rest = (arr(pos, np.int64), arr(seq, np.int64), arr(valid, np.bool_), T)
        tail = (arr(seq_lag, np.int64), arr(tok_lag, np.int64), arr(entropy, np.float64), arr(flipped, np.int64),
                D_PADDED, BIN_START, BAND_OF_BIN, ENTROPY_EDGES, *vars(self).values())
        hi = len(s) if hi is None else hi
        scratch = np.empty((6, CHUNK))  # rows CHUNK apart: the kernel's loops index them by constant offsets
        d, rm1, r, ps, em1s, pt = scratch
        bins, probs = np.empty((2, CHUNK), np.int64)
        W, XK = np.empty(NW * SUB_STRIDE), np.empty(NX * SUB_STRIDE, np.int64)
        js = None if seq_sums_out is None else np.empty(CHUNK)
        for a in range(lo, hi, CHUNK):
            b = min(hi, a + CHUNK)
            n = b - a
            with np.errstate(invalid="ignore"):  # NaN at padding: never read
                np.subtract(t[a:b], s[a:b], out=d[:n])
                np.clip(d[:n], -S.CLAMP, S.CLAMP, out=r[:n])
                np.expm1(r[:n], out=rm1[:n])
                np.exp(r[:n], out=r[:n])
                np.exp(s[a:b], out=ps[:n])
                np.expm1(s[a:b], out=em1s[:n])
                np.exp(t[a:b], out=pt[:n])
            if js is not None:
                terms = (s[a:b], t[a:b], read_only(log_cosh_half(d[:n], out=js[:n])), read_only(r[:n]))
                if len(rest[1]):  # long form: each token's sequence index
                    _seq_sums(rest[1][a:b], *terms, seq_sums_out)
                else:  # grid form: its row
                    _grid_seq_sums(rest[2], T, a, *terms, seq_sums_out)
            accumulate(s, t, scratch.reshape(-1), bins, probs, W, XK, *rest, a, b, *tail)
        return self

    def sharing_sequences(self) -> "Accumulators":
        """Empty accumulators that write their sequences' rows into this one's sequence arrays (the same
        arrays) and keep bucket, histogram and step sums of their own: for threads that take disjoint sets
        of whole sequences, which then need no merge of the sequence arrays (3 MB per 1,000 sequences)."""
        fresh = Accumulators.zeros(0, self.wide.shape[1] - LAG0)
        return Accumulators(**{name: getattr(self, name) if name in SEQUENCE_FIELDS else getattr(fresh, name)
                               for name in vars(self)})

    def merge(self, other: "Accumulators") -> "Accumulators":
        """The accumulators of both token sets: sums add (their errors too), extremes take the max. Sequence
        arrays that `other` shares with this one (`sharing_sequences`) are taken as they are."""
        out = {}
        for name, a in vars(self).items():
            b = getattr(other, name)
            if b is a:
                out[name] = a
                continue
            if name.endswith("_top") or name == "seq_max_pos":
                out[name] = np.maximum(a, b)
            elif a.ndim == 3:
                total = a[0] + b[0]
                err = np.where(np.abs(a[0]) >= np.abs(b[0]), (a[0] - total) + b[0], (b[0] - total) + a[0])
                out[name] = np.concatenate([np.stack([total, a[1] + b[1] + err]), a[2:] + b[2:]])
            else:
                out[name] = a + b
        return Accumulators(**out)


def _value(acc: np.ndarray) -> np.ndarray:
    """The compensated sums' values: sum + rounding error."""
    return acc[0] + acc[1]


def _wide_rows(sums: np.ndarray, top: np.ndarray | None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(ids of the non-empty rows, column -> values) of a [rows, NW or 3] block of sums and its maxima."""
    ids = np.flatnonzero(sums[:, 0])
    kept = sums[ids]
    out = {"n_tokens": kept[:, 0].astype(np.int64)}
    out |= {c: np.ascontiguousarray(kept[:, j]) for j, c in enumerate(WIDE[1:sums.shape[1]], 1)}
    if top is not None:
        hi = top[ids]
        out |= {c: -hi[:, j] if c.startswith("min_") else hi[:, j].copy() for j, c in enumerate(EXTREMES)}
        out[DERIVED] = np.maximum(hi[:, X_MAX_D], hi[:, X_MIN_D])
    return ids, out


def log_cosh_half(d: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """log cosh(d/2) without cancellation (as sql.log_cosh_half_sql): log1p(2 sinh²(x/2)) for |x| < 1, x = d/2,
    else |x| + log1p(e^−2|x|) − ln 2. `out`: a float64 array of d's length to write into (not d itself)."""
    x = np.multiply(np.asarray(d, np.float64), 0.5, out=out)
    np.abs(x, out=x)
    if not (x >= 1.0).any():  # the usual case: the same functions on every value, in place, without a gather or
        # scatter (NaN too, as at a grid's padding, whose value nobody reads)
        np.multiply(x, 0.5, out=x)
        np.sinh(x, out=x)
        np.multiply(x, x, out=x)  # what ** 2 computes (numpy's square)
        np.multiply(x, 2.0, out=x)
        return np.log1p(x, out=x)
    small = x < 1.0
    part = np.log1p(2.0 * np.sinh(0.5 * x[small]) ** 2)
    xl = x[~small]
    x[~small] = xl + np.log1p(np.exp(-2.0 * xl)) - math.log(2.0)
    x[small] = part
    return x


@njit(cache=True, nogil=True)
def _seq_sums(seq, s, t, js, r, out):  # pragma: no cover - compiled
    """out[:, q] += (1, s, t, js, r·t) of each token, q its sequence, token by token in order: the order in which
    np.bincount adds its weights, so the sums are the same to the last bit, in one pass instead of five. A run of
    tokens of one sequence is summed in registers from its sequence's sums and stored once (the same additions in
    the same order, without a store and load between two of them)."""
    n = len(seq)
    i = 0
    while i < n:
        q = seq[i]
        c, a1, a2, a3, a4 = out[0, q], out[1, q], out[2, q], out[3, q], out[4, q]
        while i < n and seq[i] == q:
            c += 1.0
            a1 += s[i]
            a2 += t[i]
            a3 += js[i]
            a4 += r[i] * t[i]
            i += 1
        out[0, q], out[1, q], out[2, q], out[3, q], out[4, q] = c, a1, a2, a3, a4


@njit(cache=True, nogil=True)
def _grid_seq_sums(valid, T, a, s, t, js, r, out):  # pragma: no cover - compiled
    """_seq_sums of tokens a .. a + len(s) − 1 of a [B, T] grid flattened row-major (s, t, js, r: theirs): a
    token's sequence is its row, (a + i) // T, and only the tokens `valid` keeps count (the whole flattened
    mask; empty: every token). Row by row, in token order, as np.bincount adds."""
    n = len(s)
    every = len(valid) == 0
    i = 0
    while i < n:
        q = (a + i) // T
        end = min(n, (q + 1) * T - a)
        c, a1, a2, a3, a4 = out[0, q], out[1, q], out[2, q], out[3, q], out[4, q]
        for j in range(i, end):
            if every or valid[a + j]:
                c += 1.0
                a1 += s[j]
                a2 += t[j]
                a3 += js[j]
                a4 += r[j] * t[j]
        out[0, q], out[1, q], out[2, q], out[3, q], out[4, q] = c, a1, a2, a3, a4
        i = end


PAIRWISE_BLOCK = 128  # numpy's PW_BLOCKSIZE


@_inlined
def _pairwise3_block(s, d, lo, n):  # pragma: no cover - compiled
    """(Σ s, Σ s·s, Σ s·d) over [lo, lo + n), n <= PAIRWISE_BLOCK, as numpy's pairwise_sum sums such a block."""
    if n < 8:
        a = b = c = -0.0
        for i in range(lo, lo + n):
            a += s[i]
            b += s[i] * s[i]
            c += s[i] * d[i]
        return a, b, c
    if n <= PAIRWISE_BLOCK:
        a0, a1, a2, a3, a4, a5, a6, a7 = s[lo], s[lo + 1], s[lo + 2], s[lo + 3], s[lo + 4], s[lo + 5], s[lo + 6], \
            s[lo + 7]
        b0, b1, b2, b3, b4, b5, b6, b7 = a0 * a0, a1 * a1, a2 * a2, a3 * a3, a4 * a4, a5 * a5, a6 * a6, a7 * a7
        c0, c1, c2, c3 = a0 * d[lo], a1 * d[lo + 1], a2 * d[lo + 2], a3 * d[lo + 3]
        c4, c5, c6, c7 = a4 * d[lo + 4], a5 * d[lo + 5], a6 * d[lo + 6], a7 * d[lo + 7]
        i = lo + 8
        end = lo + n - n % 8
        while i < end:
            x0, x1, x2, x3, x4, x5, x6, x7 = s[i], s[i + 1], s[i + 2], s[i + 3], s[i + 4], s[i + 5], s[i + 6], \
                s[i + 7]
            a0 += x0
            a1 += x1
            a2 += x2
            a3 += x3
            a4 += x4
            a5 += x5
            a6 += x6
            a7 += x7
            b0 += x0 * x0
            b1 += x1 * x1
            b2 += x2 * x2
            b3 += x3 * x3
            b4 += x4 * x4
            b5 += x5 * x5
            b6 += x6 * x6
            b7 += x7 * x7
            c0 += x0 * d[i]
            c1 += x1 * d[i + 1]
            c2 += x2 * d[i + 2]
            c3 += x3 * d[i + 3]
            c4 += x4 * d[i + 4]
            c5 += x5 * d[i + 5]
            c6 += x6 * d[i + 6]
            c7 += x7 * d[i + 7]
            i += 8
        ra = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
        rb = ((b0 + b1) + (b2 + b3)) + ((b4 + b5) + (b6 + b7))
        rc = ((c0 + c1) + (c2 + c3)) + ((c4 + c5) + (c6 + c7))
        while i < lo + n:
            x = s[i]
            ra += x
            rb += x * x
            rc += x * d[i]
            i += 1
        return ra, rb, rc
    return 0.0, 0.0, 0.0  # not reached: n > PAIRWISE_BLOCK is split by _pairwise3


@njit(cache=True, nogil=True)
def _pairwise3(s, d):  # pragma: no cover - compiled
    """(Σ s, Σ s·s, Σ s·d) in the order of numpy's pairwise summation, which np.sum takes over a contiguous float64
    array (numpy/_core/src/umath/loops_utils.h.src:81-145, pairwise_sum, at 1f90bbb; the same in v2.4.6, which
    this project runs): below 8 terms one running sum from −0.0; up to PAIRWISE_BLOCK terms eight running sums of
    every eighth term, added as ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)), then the rest one by one;
    above, the two halves (the first a multiple of 8 terms long) each so, then added; np.sum adds the result to
    0.0. So the logging checks' sums are np.sum's to the bit (tests/test_logging_checks.py) from one pass over s
    and d, without arrays of the products. The halves are walked with a stack of our own: a recursive version,
    loaded from numba's cache, crashed the process."""
    n = len(s)
    if n <= PAIRWISE_BLOCK:
        a, b, c = _pairwise3_block(s, d, 0, n)
        return 0.0 + a, 0.0 + b, 0.0 + c
    lo_of = np.empty(128, np.int64)  # the ranges being split, depth-first (at most 64 deep for any int64 n)
    n_of = np.empty(128, np.int64)
    stage = np.empty(128, np.int64)  # 0: left half next, 1: right half next, 2: both summed
    sums = np.empty((128, 3))  # the sums of the ranges finished, in order: a range's two halves on top
    top, done = 0, 0
    lo_of[0], n_of[0], stage[0] = 0, n, 0
    while top >= 0:
        lo, m = lo_of[top], n_of[top]
        if m <= PAIRWISE_BLOCK:
            sums[done, 0], sums[done, 1], sums[done, 2] = _pairwise3_block(s, d, lo, m)
            done += 1
            top -= 1
            continue
        half = m // 2
        half -= half % 8
        if stage[top] == 2:
            for j in range(3):
                sums[done - 2, j] = sums[done - 2, j] + sums[done - 1, j]
            done -= 1
            top -= 1
            continue
        first = stage[top] == 0
        stage[top] += 1
        top += 1
        lo_of[top], n_of[top], stage[top] = (lo, half, 0) if first else (lo + half, m - half, 0)
    return 0.0 + sums[0, 0], 0.0 + sums[0, 1], 0.0 + sums[0, 2]


@njit(cache=True, nogil=True)
def neighbours(seq, pos, s, t, d, prev, nxt, has_prev, has_next, sums, strict):  # pragma: no cover - compiled
    """The neighbouring tokens of a batch in key order (key = sequence · 2^32 + position, from seq and pos): for
    each pair i, i + 1 with key[i + 1] = key[i] + 1, in order, prev[j] = |t[i+1] − s[i]| and nxt[j] =
    |t[i] − s[i+1]|; has_prev[i] (a neighbour before it here, or position 0) and has_next[i]; sums[:] = Σ s,
    Σ s², Σ s·d as np.sum gives them (_pairwise3; d = t − s). Returns the number of pairs; `strict`: −1 where
    the keys do not increase strictly (what it wrote then means nothing). One pass for checks.CheckSums, where
    numpy's masks, gathers and products made fifteen."""
    n = len(seq)
    m = 0
    if n:
        has_prev[0] = pos[0] == 0
        has_next[n - 1] = False
        key = seq[0] << 32 | pos[0]
    for i in range(n - 1):
        following = seq[i + 1] << 32 | pos[i + 1]
        if strict and following <= key:
            return -1
        adj = following == key + 1
        has_next[i] = adj
        has_prev[i + 1] = adj or pos[i + 1] == 0
        if adj:
            prev[m] = abs(t[i + 1] - s[i])
            nxt[m] = abs(t[i] - s[i + 1])
            m += 1
        key = following
    sums[0], sums[1], sums[2] = _pairwise3(s, d)
    return m


def tables(acc: Accumulators, samples: np.ndarray, lag_lo: int = 0, n_lag: int = 0,
           routed: bool = False) -> dict[str, dict]:
    """The summary rows of the accumulated tokens, as the torch writer returns them (columns as numpy arrays,
    no run/step/file_id): summary_seq, summary_seq_band, summary_step, summary_hist, summary_bucket,
    summary_bucket_band. `samples` maps the dense sequence index to the sample id; lag row k is lag lag_lo + k;
    routed: the flip columns were accumulated (trainer routing given)."""
    ids, seq = _wide_rows(_value(acc.seq), acc.seq_top)
    seq["max_pos"] = acc.seq_max_pos[ids]
    seq["sample"] = samples[ids]
    if routed:
        seq["n_flip_tokens"] = acc.seq_flip[ids]
    out = {"summary_seq": seq if len(ids) else {}}
    cells, cell = _wide_rows(_value(acc.seq_band), None)
    out["summary_seq_band"] = {"sample": samples[cells // NB], "band": cells % NB} | cell if len(ids) else {}
    wide = _value(acc.wide)
    step_ids, step = _wide_rows(wide[STEP:STEP + 1], acc.wide_top[STEP:STEP + 1])
    if len(step_ids):
        step = {k: v.tolist() for k, v in step.items()}
        if routed:
            flips = _value(acc.flip)[0]
            step["n_routed"] = [int(flips[6])]
            step |= {c: [int(flips[j]) if c.startswith("n_") or c == "sum_flipped_layers" else float(flips[j])]
                     for j, c in enumerate(FLIPS)}
        out["summary_step"] = step
    else:
        out["summary_step"] = {}
    bins, hist = _wide_rows(_value(acc.hist), None)
    out["summary_hist"] = {"bin": bins} | hist
    dims = dict(DIMS) | {"lag": (LAG0, n_lag)}
    offsets = {"lag": lag_lo}
    buckets, banded = [], []
    band = _value(acc.band)
    for dim, (first, n) in dims.items():
        b_ids, rows = _wide_rows(wide[first:first + n], acc.wide_top[first:first + n])
        if dim == "entropy" and not len(b_ids):
            continue
        buckets.append({"dim": np.full(len(b_ids), dim, dtype=object), "bucket": b_ids + offsets.get(dim, 0)} | rows)
        c_ids, c_rows = _wide_rows(band[first * NB:(first + n) * NB], None)
        banded.append({"dim": np.full(len(c_ids), dim, dtype=object), "bucket": c_ids // NB + offsets.get(dim, 0),
                       "band": c_ids % NB} | c_rows)
    out["summary_bucket"] = {k: np.concatenate([p[k] for p in buckets]) for k in buckets[0]}
    out["summary_bucket_band"] = {k: np.concatenate([p[k] for p in banded]) for k in banded[0]}
    return out


# -- the logging checks' sums of a [B, T] step (DriftLogger on the CPU) ----------------------------------------

@njit(cache=True, nogil=True, error_model="numpy")
def _grid_sums(s, t, mask, full, out, err):
    """CHECK_SUMS of [B, T] log-probs (a sequence per row, position = column) over the mask==1 tokens, in one pass
    with no temporary: each row's plain sums, added into out (and their rounding errors into err, Neumaier's rule)
    row by row. out: Σs, Σs², Σs·Δ, Σ|t_(p+1) − s_p|, Σ|t_p − s_(p+1)|, tokens, pairs."""
    B, T = s.shape
    row = np.zeros(7)
    for b in range(B):
        row[:] = 0.0
        for p in range(T):
            if full or mask[b, p]:
                si, ti = s[b, p], t[b, p]
                row[0] += si
                row[1] += si * si
                row[2] += si * (ti - si)
                row[5] += 1.0
                if p + 1 < T and (full or mask[b, p + 1]):
                    row[3] += abs(t[b, p + 1] - si)
                    row[4] += abs(ti - s[b, p + 1])
                    row[6] += 1.0
        for j in range(7):
            x, acc = row[j], out[j]
            total = acc + x
            err[j] += (acc - total) + x if abs(acc) >= abs(x) else (x - total) + acc
            out[j] = total


def grid_sums(s: np.ndarray, t: np.ndarray, mask: np.ndarray) -> dict[str, float | int]:
    """schema.CHECK_SUMS (summaries/checks.py) of a step's [B, T] float64 log-probs and bool mask (numpy, C order); padding may hold
    anything. One pass of a numba loop: torch's reductions of the same sums took ~80 ms a step of 1M positions
    beside the summary kernel's threads on 2 cores (~8 ms on one thread), this ~3 ms."""
    out, err = np.zeros(7), np.zeros(7)
    _grid_sums(np.ascontiguousarray(s, np.float64), np.ascontiguousarray(t, np.float64),
               np.ascontiguousarray(mask, np.bool_), bool(mask.all()), out, err)
    v = out + err
    return {"n_check_tokens": int(v[5]), "sum_s": float(v[0]), "sum_s2": float(v[1]), "sum_sd": float(v[2]),
            "n_adj": int(v[6]), "sum_abs_lag_prev": float(v[3]), "sum_abs_lag_next": float(v[4])}
