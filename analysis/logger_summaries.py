"""The summaries DriftLogger writes for each step, reduced with torch on the device the tensors are on.

They are the rows of the summary tables (analysis/summaries/schema.py) that ingest would compute from the
step's tokens and routing (analysis/summaries/compute.py), so a trainer can write a sample of its tokens while
every view above token level stays exact. The per-token terms follow compute.py's definitions; reductions are
float64 (inputs are widened first), with no Python loop per token or sequence; only reduced rows leave the device.

Grouping: one pass groups tokens by (sequence, ratio band), the summary_seq rows; the step row is reduced from
those rows. Δ bins and the (bucket, band) rows of each bucket dimension are one pass each (`_Groups`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from analysis.summaries import schema as S
from analysis.token_sample import Kept, SamplePlan

SUMMARISED_KEY = S.SUMMARISED_KEY.decode()  # on token/routing files whose summaries come in a summary file
SUMMARISED_VALUE = S.SUMMARISED_VALUE.decode()
SAMPLE_TABLE = "summary_sample"  # per (run, step): what the step's token rows are a sample of
EXPERT_LOAD = "expert_load"  # per (run, step, layer, expert) routed-token counts, as ingest aggregates them
CHUNK_TOKENS = 1 << 20  # positions per chunk of the token reductions: bounds their [n, columns] temporaries
ROUTING_CHUNK = 1 << 16  # tokens per chunk of the routing comparisons: bounds the [n, L, K, K] temporaries

_SUMS = [c.name for c in S.TOKEN_SUMS if c.name.startswith("sum_")]
_MAXES = [c.name for c in S.TOKEN_SUMS if c.name.startswith(("min_", "max_"))]


@dataclass
class StepTensors:
    """One step's checked inputs on their device: float64 log-probs, bool mask, int64 ids."""
    s: torch.Tensor  # [B, T] float64
    t: torch.Tensor  # [B, T] float64
    delta: torch.Tensor  # t − s
    mask: torch.Tensor  # [B, T] bool
    samples: torch.Tensor  # [B] int64 sequence ids
    token_ids: torch.Tensor | None  # [B, T]
    sampler_version: torch.Tensor | None  # [B, T] int64
    trainer_version: torch.Tensor | None
    sampler_experts: torch.Tensor | None  # [B, T, L, K]
    trainer_experts: torch.Tensor | None

    @property
    def device(self) -> torch.device:
        return self.s.device


def _series_k3(x: torch.Tensor) -> torch.Tensor:
    """e^x − 1 − x by its Taylor series to x^8, evaluated as compute.series_k3_sql does (same Horner order)."""
    coefs = [2, 6, 24, 120, 720, 5040, 40320]
    inner = torch.full_like(x, 1.0 / coefs[-1])
    for c in reversed(coefs[:-1]):
        inner.mul_(x).add_(1.0 / c)
    return inner.mul_(x).mul_(x)


@dataclass
class Terms:
    """The per-token terms of a chunk, each a row of one of two matrices, so that a grouping adds every
    token's row of sums (and takes its row of maxima) in one call, without stacking copies."""
    sums: torch.Tensor  # [len(_SUMS) + 1, n]: the _SUMS terms, then 1 (the count)
    maxes: torch.Tensor  # [len(_MAXES) + 1, n]: the _MAXES terms (minima negated), then pos (for max_pos)
    row: dict[str, torch.Tensor]  # name -> its row (a view)


def token_terms(s: torch.Tensor, t: torch.Tensor) -> Terms:
    """Per-token terms of summaries/schema.py for 1-D float64 s, t."""
    n = len(s)
    V = torch.empty(len(_SUMS) + 1, n, dtype=torch.float64, device=s.device)
    M = torch.empty(len(_MAXES) + 1, n, dtype=torch.float64, device=s.device)
    r = {c: V[j] for j, c in enumerate(_SUMS)} | {c: M[j] for j, c in enumerate(_MAXES)}
    r["ones"], r["pos"] = V[-1], M[-1]
    r["ones"].fill_(1.0)
    # compute.token_terms_sql's forms: two expm1 per token, the other terms from them without cancellation
    d = torch.sub(t, s, out=r["sum_d"])
    cd = d.clamp(-S.CLAMP, S.CLAMP)
    rm1 = torch.expm1(cd, out=r["sum_rm1"])
    em = torch.exp(cd).reciprocal_().mul_(rm1).neg_()  # expm1(−cd) = −(r − 1)/r
    torch.mul(d, d, out=r["sum_d2"])
    abs_d = torch.abs(d, out=r["sum_abs_d"])
    small = abs_d < S.SERIES_BELOW
    torch.where(small, _series_k3(d), (rm1 - d).clamp_(min=0.0), out=r["sum_k3"])
    torch.where(small, _series_k3(-d), (em + d).clamp_(min=0.0), out=r["sum_k3r"])
    torch.mul(rm1, rm1, out=r["sum_rm1_sq"])
    torch.where(cd >= 0, rm1, em, out=r["sum_mpe"])  # expm1(|cd|)
    ps, pt = torch.exp(s, out=r["sum_ps"]), torch.exp(t, out=r["sum_pt"])
    dp = torch.where(d == cd, ps * rm1, pt - ps)  # exp t − exp s: exp s · (r − 1) unless Δ is clamped
    qs = torch.expm1(s, out=r["sum_qs"]).neg_()
    qt = torch.sub(qs, dp, out=r["sum_qt"])
    adp = torch.abs(dp, out=r["sum_adp"])
    torch.mul(qs, qs, out=r["sum_qs2"])
    torch.mul(qt, qt, out=r["sum_qt2"])
    torch.mul(qs, qt, out=r["sum_qsqt"])
    torch.mul(ps, ps, out=r["sum_ps2"])
    torch.mul(pt, pt, out=r["sum_pt2"])
    torch.mul(ps, pt, out=r["sum_pspt"])
    # extremes, each as a value whose maximum is wanted (minima negated, which is exact)
    for name, value in (("max_abs_d", abs_d), ("max_d", d), ("max_adp", adp), ("max_s", s), ("max_t", t)):
        r[name].copy_(value)
    for name, value in (("min_d", d), ("min_s", s), ("min_t", t)):
        torch.neg(value, out=r[name])
    return Terms(V, M, r)


def bin_of(x: torch.Tensor, edges: tuple[float, ...]) -> torch.Tensor:
    """The schema's bin id 2·#{E < x} + 𝟙[x on an edge] of each x (int64)."""
    e = torch.tensor(edges, dtype=torch.float64, device=x.device)
    below = torch.searchsorted(e, x)  # left: #{E < x}
    on_edge = e[below.clamp(max=len(edges) - 1)] == x
    return 2 * below + on_edge


class _Groups:
    """Sums, counts and extremes of the token terms per group id in [0, n_groups), accumulated chunk by chunk
    (merging is addition, min and max). Sums go through one accumulating `index_put_` of each token's row of
    terms (about 10x faster on CPU than one bincount per column), extremes through one `scatter_reduce_`."""

    def __init__(self, n_groups: int, device: torch.device, sums: list[str] = _SUMS, maxes: list[str] = _MAXES,
                 with_pos: bool = False):
        self.sums, self.maxes, self.with_pos = sums, maxes, with_pos
        self.total = torch.zeros(n_groups, len(sums) + 1, dtype=torch.float64, device=device)  # + the count
        n_max = len(maxes) + with_pos
        self.top = torch.full((n_groups, n_max), -math.inf, dtype=torch.float64, device=device)

    def add(self, index: torch.Tensor, terms: Terms) -> None:
        if self.sums is _SUMS:
            values = terms.sums.T  # a view: index_put_ reads the strided rows without a copy
        else:
            values = torch.stack([terms.row[c] for c in self.sums] + [terms.row["ones"]], 1)
        self.total.index_put_((index,), values, accumulate=True)
        if self.maxes:
            top = terms.maxes.T if self.with_pos else terms.maxes[:-1].T
            self.top.scatter_reduce_(0, index[:, None].expand(-1, top.shape[1]), top, "amax")

    def rows(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(ids of the non-empty groups, column -> value per such group)."""
        count = self.total[:, -1]
        ids = count.nonzero().squeeze(1)
        out = {"n_tokens": count[ids].to(torch.int64)}  # exact: a float64 count of < 2^53 tokens
        total = self.total[ids]  # one gather of the non-empty rows, then column views
        out |= {c: total[:, j] for j, c in enumerate(self.sums)}
        top = self.top[ids]
        out |= {c: -top[:, j] if c.startswith("min_") else top[:, j] for j, c in enumerate(self.maxes)}
        if self.with_pos:
            out["max_pos"] = top[:, -1].to(torch.int64)
        return ids, out


@dataclass
class _Routing:
    """Per-token routing facts of the trained tokens (None without the trainer's side)."""
    n_flipped_layers: torch.Tensor | None  # [n] int64
    layer_rows: dict[str, list[int]]  # summary_layer columns, one value per layer
    expert_load: dict[str, list[int]]


def _routing(x: StepTensors, flat: torch.Tensor) -> _Routing:
    B, T, L, K = x.sampler_experts.shape
    se_all = x.sampler_experts.reshape(B * T, L, K)
    te_all = x.trainer_experts.reshape(B * T, L, K) if x.trainer_experts is not None else None
    n = len(flat)
    n_experts = int(se_all.max()) + 1 if se_all.numel() else 1
    if te_all is not None and te_all.numel():
        n_experts = max(n_experts, int(te_all.max()) + 1)
    dev = se_all.device
    load = {"n_sampler": torch.zeros(L * n_experts, dtype=torch.int64, device=dev)}
    layer_base = (torch.arange(L, device=dev) * n_experts)[None, :, None]
    both = te_all is not None
    if both:
        load["n_trainer"] = torch.zeros_like(load["n_sampler"])
        n_flip = torch.zeros(L, dtype=torch.int64, device=dev)
        n_top1, common = torch.zeros_like(n_flip), torch.zeros_like(n_flip)
        first = torch.zeros_like(n_flip)
        flipped_layers = torch.empty(n, dtype=torch.int64, device=dev)
    for lo in range(0, n, ROUTING_CHUNK):
        rows = flat[lo:lo + ROUTING_CHUNK]
        se = se_all[rows].to(torch.int64)  # [c, L, K]
        load["n_sampler"] += torch.bincount((layer_base + se).reshape(-1), minlength=L * n_experts)
        if not both:
            continue
        te = te_all[rows].to(torch.int64)
        load["n_trainer"] += torch.bincount((layer_base + te).reshape(-1), minlength=L * n_experts)
        flip = (se.sort(-1).values != te.sort(-1).values).any(-1)  # [c, L]: sets differ
        n_flip += flip.sum(0)
        n_top1 += (se[..., 0] != te[..., 0]).sum(0)
        common += (se[..., :, None] == te[..., None, :]).sum((-2, -1)).sum(0)
        any_flip = flip.any(1)
        first += torch.bincount(flip[any_flip].to(torch.int8).argmax(1), minlength=L)  # lowest flipped layer
        flipped_layers[lo:lo + len(rows)] = flip.sum(1)
    zeros, nulls = [0] * L, [None] * L  # as ingest's SQL has them: count_if over no trainer side is NULL
    layer_rows = {"layer": list(range(L)), "k": [K] * L, "n_rows": [n] * L, "n_both": [n if both else 0] * L,
                  "n_flip": n_flip.tolist() if both else nulls, "n_top1": n_top1.tolist() if both else nulls,
                  "sum_common": common.tolist() if both else zeros, "n_first_flip": first.tolist() if both else zeros}
    if n == 0:
        layer_rows = {k: [] for k in layer_rows}
    counts = {side: c.reshape(L, n_experts) for side, c in load.items()}
    seen = sum(counts.values()) > 0
    layer, expert = seen.nonzero().unbind(1)
    expert_load = {"layer": layer.tolist(), "expert": expert.tolist()}
    expert_load |= {side: c[layer, expert].tolist() for side, c in counts.items()}
    expert_load.setdefault("n_trainer", [0] * len(layer))  # ingest counts 0 for a side not recorded
    return _Routing(flipped_layers if both else None, layer_rows, expert_load)


def _host(values: dict[str, torch.Tensor | list]) -> dict[str, np.ndarray | list]:
    """Columns to the host as numpy arrays (Arrow takes them without a copy; lists of Python floats are slow)."""
    return {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def summarise(x: StepTensors, kept: Kept, plan: SamplePlan) -> dict[str, dict[str, list]]:
    """Summary table name -> the step's rows of that table, as columns (no run/step/file_id).

    Tokens are reduced in chunks of whole sequences (about CHUNK_TOKENS positions), which bounds the
    temporaries whatever the step's size; a sequence's rows are complete within its chunk."""
    B, T = x.mask.shape
    dev = x.device
    flat = x.mask.reshape(-1).nonzero().squeeze(1)  # the trained tokens, row-major
    tables: dict[str, dict] = {SAMPLE_TABLE: sample_record(kept, plan)}
    routing = _routing(x, flat) if x.sampler_experts is not None else None
    flipped = routing.n_flipped_layers if routing is not None else None
    lag = None
    if x.sampler_version is not None and x.trainer_version is not None:
        lag = (x.trainer_version - x.sampler_version).reshape(-1)[flat]
    lag_lo = int(lag.min()) if lag is not None and len(lag) else 0
    lag_n = int(lag.max()) - lag_lo + 1 if lag is not None and len(lag) else 1
    dims = {"prob": _Groups(S.PROB_BINS * S.N_BANDS, dev), "position": _Groups(32 * S.N_BANDS, dev)}
    if lag is not None:
        dims["lag"] = _Groups(lag_n * S.N_BANDS, dev)
    hist = _Groups(S.N_BINS, dev, ["sum_rm1", "sum_rm1_sq"], [])
    powers = 2 ** torch.arange(31, device=dev)
    seq_parts, flip_parts = [], []
    rows_per_chunk = max(1, CHUNK_TOKENS // max(T, 1))
    lo = 0  # index in flat of the chunk's first token
    for r0 in range(0, B, rows_per_chunk):
        hi = lo + int(x.mask[r0:r0 + rows_per_chunk].sum())
        if hi == lo:
            continue
        idx = flat[lo:hi]
        b, pos = idx // T, idx % T
        s, t = x.s.reshape(-1)[idx], x.t.reshape(-1)[idx]
        terms = token_terms(s, t)
        d = terms.row["max_d"]
        band = bin_of(d, S.BAND_EDGES)
        terms.row["pos"].copy_(pos)
        n_rows = min(rows_per_chunk, B - r0)
        seq = _Groups(n_rows * S.N_BANDS, dev, with_pos=True)
        seq_index = (b - r0) * S.N_BANDS + band
        seq.add(seq_index, terms)
        ids, rows = seq.rows()
        part = {"sample": x.samples[r0 + ids // S.N_BANDS], "band": ids % S.N_BANDS} | rows
        if flipped is not None:
            fl = flipped[lo:hi] > 0
            part["n_flip_tokens"] = torch.bincount(seq_index[fl], minlength=n_rows * S.N_BANDS)[ids]
            flip_parts.append({"n_any_flip": fl.sum(), "sum_flipped_layers": flipped[lo:hi].sum(),
                               "sum_abs_d_flip": terms.row["sum_abs_d"][fl].sum(),
                               "sum_k3_flip": terms.row["sum_k3"][fl].sum(),
                               "sum_abs_d_noflip": terms.row["sum_abs_d"][~fl].sum(),
                               "sum_k3_noflip": terms.row["sum_k3"][~fl].sum()})
        seq_parts.append(part)
        hist.add(bin_of(d, S.D_EDGES), terms)
        prob = torch.floor((s / math.log(10) - S.PROB_LO) / S.PROB_WIDTH).clamp(0, S.PROB_BINS - 1).to(torch.int64)
        dims["prob"].add(prob * S.N_BANDS + band, terms)
        dims["position"].add(torch.searchsorted(powers, pos, right=True) * S.N_BANDS + band, terms)
        if lag is not None:
            dims["lag"].add((lag[lo:hi] - lag_lo) * S.N_BANDS + band, terms)
        lo = hi

    seq = {k: torch.cat([p[k] for p in seq_parts]) for k in seq_parts[0]} if seq_parts else {}
    tables["summary_seq"] = _host(seq)
    step_row = {}
    if seq_parts:
        step_row = {"n_tokens": [int(seq["n_tokens"].sum())]}
        step_row |= {c: [float(seq[c].sum())] for c in _SUMS}
        step_row |= {c: [float(seq[c].min() if c.startswith("min_") else seq[c].max())] for c in _MAXES}
        if flipped is not None:
            step_row |= {"n_routed": [len(flipped)]}
            step_row |= {k: [sum(p[k] for p in flip_parts).item()] for k in flip_parts[0]}
    tables["summary_step"] = step_row
    bins, rows = hist.rows()
    tables["summary_hist"] = _host({"bin": bins} | rows)
    parts = []
    for dim, groups in dims.items():
        ids, rows = groups.rows()
        bucket = ids // S.N_BANDS + (lag_lo if dim == "lag" else 0)
        parts.append(_host({"dim": np.full(len(ids), dim, dtype=object), "bucket": bucket,
                            "band": ids % S.N_BANDS} | rows))
    tables["summary_bucket"] = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    if routing is not None:
        tables["summary_layer"] = routing.layer_rows
        tables[EXPERT_LOAD] = routing.expert_load
    return tables


def sample_record(kept: Kept, plan: SamplePlan) -> dict[str, list]:
    """One row saying what the step's token rows are: the summaries cover n_tokens, the rows hold n_kept."""
    return {"token_sample": [float(plan.rate)], "worst_sequences": [plan.worst_sequences],
            "top_tokens": [plan.top_tokens], "n_tokens": [kept.n_tokens], "n_kept": [kept.n_kept],
            "n_uniform": [kept.n_uniform], "n_worst_seq_tokens": [kept.n_worst_sequence_tokens],
            "n_top_tokens": [kept.n_top_tokens]}


__all__ = ["StepTensors", "summarise", "token_terms", "bin_of", "SUMMARISED_KEY", "SAMPLE_TABLE", "EXPERT_LOAD"]
