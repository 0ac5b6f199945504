"""Router margins in DriftLogger: their checks, and the step's margin sums (METRICS.md v3 "Routing margins").

A margin is the k-th minus the (k+1)-th router probability of a (token, layer) row: how close the router was to
picking another expert (summaries/margins.py). RouterCapture computes it from the router logits it hooks; an
engine that reports its router's scores can give the sampler's. Per step the logger writes, per layer, the count
and Σ of each side's margins (summary_layer, schema.MARGIN_SUMS), and per (layer, side, margin bin) the rows with
both sides' experts, their flips and Σ |Δ| (summary_margin), reduced with torch on the tensors' device. Margins
are rounded to fp32 first (they are stored so), and the sums read that value, as ingest's SQL does.
"""
from __future__ import annotations

import numpy as np
import torch
from numba import njit

from analysis.record.pieces import in_pieces
from analysis.summaries import schema as S
from analysis.summaries.margins import N_MARGIN_BINS

CHUNK = 1 << 16  # trained tokens per chunk: bounds the [c, L, K] sorts
PIECE = 1 << 15  # positions a thread of the CPU pass takes at a time


@njit(cache=True, nogil=True, error_model="numpy")
def margin_pass(se, te, sm, tm, abs_d, valid, has_t, has_sm, has_tm, edges, sums, cells):  # pragma: no cover
    """DriftLogger's margin sums of [N, L, K] expert ids on the CPU in one pass (this module's torch ops
    elsewhere): per side (0 sampler, 1 trainer) and layer, sums[side, layer] += the margin (fp32 sm / tm [N, L],
    widened); with the trainer's ids (has_t), cells[side, 0 | 1 | 2, layer, bin] += 1, 𝟙[flip], |Δ| of the
    position (abs_d [N]) at the margin's bin on the interior `edges`. A flip: some sampler id's count in the
    trainer's list differs from its count in its own (the expert multisets differ), as fulldist.routing_pass.
    Positions with valid[i] false are skipped."""
    N, L, K = se.shape
    for i in range(N):
        if not valid[i]:
            continue
        d = abs_d[i]
        for layer in range(L):
            flip = False
            if has_t:
                for a in range(K):
                    x = se[i, layer, a]
                    cs = 0
                    ct = 0
                    for b in range(K):
                        cs += se[i, layer, b] == x
                        ct += te[i, layer, b] == x
                    flip |= cs != ct
            for side in range(2):
                if (side == 0 and not has_sm) or (side == 1 and not has_tm):
                    continue
                m = np.float64(sm[i, layer]) if side == 0 else np.float64(tm[i, layer])
                sums[side, layer] += m
                if has_t:
                    b = 0
                    for e in edges:
                        b += m >= e
                    cells[side, 0, layer, b] += 1.0
                    cells[side, 1, layer, b] += 1.0 if flip else 0.0
                    cells[side, 2, layer, b] += d



def checked_margins(margins, experts: torch.Tensor | None, mask: torch.Tensor, name: str,
                    side: str) -> torch.Tensor | None:
    """A [B, T, L] margin tensor, checked: it needs its side's experts ([B, T, L, K]: one margin per routing
    layer), floating point, in [0, 1] at the trained positions (the padding may hold anything)."""
    if margins is None:
        return None
    if experts is None:
        raise ValueError(f"{name}: given without {side} (a margin belongs to that side's routing)")
    m = margins if isinstance(margins, torch.Tensor) else torch.as_tensor(margins)
    m = m.to(mask.device)
    if not m.is_floating_point():
        raise ValueError(f"{name}: expected floating-point margins, got dtype {m.dtype}")
    want = tuple(experts.shape[:3])
    if tuple(m.shape) != want:
        raise ValueError(f"{name}: expected shape {list(want)} (B, T, L of {side}), got {list(m.shape)}")
    lo, hi = torch.aminmax(m) if m.numel() else (torch.zeros(()), torch.zeros(()))  # one pass; NaN fails both
    if bool(lo >= 0) and bool(hi <= 1):
        return m
    bad = ~((m >= 0) & (m <= 1)).all(-1) & mask  # the padding may hold anything
    if bad.any():
        b, p = (int(i) for i in bad.nonzero()[0])
        layer = int((~((m[b, p] >= 0) & (m[b, p] <= 1))).nonzero()[0])
        raise ValueError(f"{name}[{b}, {p}, {layer}] = {float(m[b, p, layer])!r}: a router margin (k-th minus "
                         "(k+1)-th expert probability) is in [0, 1] (mask the token out if it is padding)")
    return m


def margin_tables(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor, sampler_experts: torch.Tensor,
                  trainer_experts: torch.Tensor | None, margins: dict[str, torch.Tensor | None],
                  engine: str = "auto", pool=None) -> tuple[dict[str, list], dict[str, list]]:
    """(the MARGIN_SUMS columns of the step's L summary_layer rows, its summary_margin rows as columns) over the
    trained positions; `margins`: side -> [B, T, L] margins or None. s, t: [B, T] float64 log-probs. engine:
    "kernel" is one numba pass (margin_pass below, CPU tensors; a sort per row as torch ops cost
    ~3x the rest of such a step), "torch" torch ops on the tensors' device; "auto" the kernel on the CPU.
    pool: an executor whose threads take pieces of the kernel's positions too (torch.get_num_threads() in all)."""
    B, T, L, K = sampler_experts.shape
    dev = mask.device
    sides = {side: m.reshape(B * T, L) for side, m in margins.items() if m is not None}
    if engine == "kernel" or (engine == "auto" and dev.type == "cpu"):
        empty = np.zeros((0, 0), np.float32)

        def fp32(side):
            return sides[side].to(torch.float32).contiguous().numpy() if side in sides else empty
        args = (_ints(sampler_experts.reshape(B * T, L, K)),
                _ints(trainer_experts.reshape(B * T, L, K) if trainer_experts is not None else
                      sampler_experts.reshape(B * T, L, K)),
                fp32("sampler"), fp32("trainer"), (t - s).abs().reshape(-1).contiguous().numpy(),
                mask.reshape(-1).contiguous().numpy())
        flags = (trainer_experts is not None, "sampler" in sides, "trainer" in sides, np.asarray(S.MARGIN_EDGES[1:-1]))
        threads = min(torch.get_num_threads(), max(1, B * T * L // (2 * PIECE))) if pool is not None else 1
        outs = in_pieces(B * T, PIECE, threads, pool, lambda i: (np.zeros((2, L)), np.zeros((2, 3, L, N_MARGIN_BINS))),
                         lambda out, lo, hi: margin_pass(*(a[lo:hi] for a in args), *flags, *out))
        sums_np, cells_np = outs[0]
        for a, b in outs[1:]:
            sums_np += a
            cells_np += b
        sums = {side: torch.from_numpy(sums_np[j]) for j, side in enumerate(S.MARGIN_SIDES) if side in sides}
        cells = {side: torch.from_numpy(cells_np[j].reshape(3, L * N_MARGIN_BINS))
                 for j, side in enumerate(S.MARGIN_SIDES) if side in sides}
        return _tables(int(mask.sum()), L, sides, sums, cells, trainer_experts is not None)
    flat = mask.reshape(-1).nonzero().squeeze(1)
    abs_d = (t - s).abs().reshape(-1)
    edges = torch.tensor(S.MARGIN_EDGES[1:-1], dtype=torch.float64, device=dev)
    se_all = sampler_experts.reshape(B * T, L, K)
    te_all = trainer_experts.reshape(B * T, L, K) if trainer_experts is not None else None
    sums = {side: torch.zeros(L, dtype=torch.float64, device=dev) for side in sides}
    cells = {side: torch.zeros(3, L * N_MARGIN_BINS, dtype=torch.float64, device=dev) for side in sides}
    layer_base = torch.arange(L, device=dev) * N_MARGIN_BINS
    for lo in range(0, len(flat), CHUNK):
        rows = flat[lo:lo + CHUNK]
        flip = None
        if te_all is not None:  # sets differ: the sorted lists differ
            flip = (se_all[rows].sort(-1).values != te_all[rows].sort(-1).values).any(-1).to(torch.float64)
        d = abs_d[rows][:, None].expand(-1, L)
        for side, m_all in sides.items():
            m = m_all[rows].to(torch.float32).to(torch.float64)  # [c, L], as stored
            sums[side] += m.sum(0)
            if flip is None:
                continue
            idx = (layer_base + torch.bucketize(m, edges, right=True)).reshape(-1)
            n = L * N_MARGIN_BINS
            cells[side][0] += torch.bincount(idx, minlength=n).to(torch.float64)
            cells[side][1] += torch.bincount(idx, weights=flip.reshape(-1), minlength=n)
            cells[side][2] += torch.bincount(idx, weights=d.reshape(-1), minlength=n)
    return _tables(len(flat), L, sides, sums, cells, te_all is not None)


def _ints(e: torch.Tensor) -> np.ndarray:
    return e.contiguous().numpy()


def _tables(n_rows: int, L: int, sides: dict, sums: dict[str, torch.Tensor], cells: dict[str, torch.Tensor],
            both: bool) -> tuple[dict[str, list], dict[str, list]]:
    """The summary_layer margin columns and the summary_margin rows of per-side sums [L] and cells [3, L · bins]."""
    layer_cols: dict[str, list] = {}
    for side in S.MARGIN_SIDES:
        have = side in sides
        layer_cols[f"n_margin_{side}"] = [n_rows if have else 0] * L
        layer_cols[f"sum_margin_{side}"] = sums[side].tolist() if have else [0.0] * L
    out: dict[str, list] = {"layer": [], "side": [], "margin_bin": [], "n_rows": [], "n_flip": [], "sum_abs_d": []}
    if both:
        for side in sides:
            c = cells[side].cpu()
            for j in c[0].nonzero().squeeze(1).tolist():
                out["layer"].append(j // N_MARGIN_BINS)
                out["side"].append(side)
                out["margin_bin"].append(j % N_MARGIN_BINS)
                out["n_rows"].append(int(c[0, j]))
                out["n_flip"].append(int(c[1, j]))
                out["sum_abs_d"].append(float(c[2, j]))
    return layer_cols, out
