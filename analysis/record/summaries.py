"""The summaries DriftLogger writes for each step, reduced with torch on the device the tensors are on.

They are the rows of the summary tables (analysis/summaries/schema.py, layout 2) that ingest would compute from
the step's tokens and routing (analysis/ingest/summarise.py), so a trainer can write a sample of its tokens
while every view above token level stays exact. The per-token terms follow compute.py's definitions;
reductions are float64 (inputs are widened first), with no Python loop per token or sequence; only reduced rows
leave the device.

How the work is laid out (the step is [B, T], one sequence per row; chunks of whole rows bound the memory):

- the wide sums are computed once per position into a term-major block V [terms, rows, T] (padding holds 0),
  and the extremes into X [extremes, rows, T] (padding holds −inf, minima negated so every extreme is a max);
- one pass over the block reduces each row's positions per position bucket (a bucket is a contiguous range of
  positions); summary_seq rows and the position buckets both follow from those partial sums and maxima, and
  summary_step sums the sequence rows;
- lag buckets, when the lag is one per sequence (the usual [B] versions), group the sequence rows by lag;
- prob buckets (and per-token lags) are the only wide per-token scatter (`scatter_add_` of the rows of V);
- the ratio-band tables (seq × band, bucket × band, the Δ histogram) carry only (count, Σ r − 1, Σ (r − 1)²),
  the first three rows of V: one narrow scatter per (sequence, band), and one into the joint
  (Δ bin, prob, position bucket) cells, from which the histogram and the prob × band and position × band rows
  are marginals (BAND_EDGES ⊂ D_EDGES, so a Δ bin lies in one band).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from analysis.record.checks import check_sums
from analysis.record.residual import residual_sums
from analysis.record.fulldist import routing_problem, seq_topk_columns, topk_sums, topk_sums_torch, weight_diff
from analysis.record.margins import margin_tables
from analysis.record.pieces import in_pieces
from analysis.record.token_sample import Kept, SamplePlan
from analysis.summaries import fulldist, kernel
from analysis.summaries import schema as S
from analysis.summaries.kernel import DERIVED, EXTREMES, NARROW, WIDE

SUMMARISED_KEY = S.SUMMARISED_KEY.decode()  # on token/routing files whose summaries come in a summary file
SUMMARISED_VALUE = S.SUMMARISED_VALUE.decode()
SAMPLE_TABLE = "summary_sample"  # per (run, step): what the step's token rows are a sample of
EXPERT_LOAD = "expert_load"  # per (run, step, layer, expert) routed-token counts, as ingest aggregates them
CHUNK_TOKENS = 1 << 18  # positions per chunk of whole rows: bounds the [terms, rows, T] blocks (~60 MB)
ROUTING_CHUNK = 1 << 16  # tokens per chunk of the routing comparisons: bounds the [n, L, K, K] temporaries

# Rows of the term block V (the kernel's columns): the band tables' three first (count, Σ r − 1, Σ (r − 1)²),
# then the other sums; rows of the extremes block X, each a value whose maximum is wanted (a minimum is stored
# negated, which is exact); max_abs_d is not a row: it is max(max_d, −min_d).
_W = {c: j for j, c in enumerate(WIDE)}
_X = {c: j for j, c in enumerate(EXTREMES)}


@dataclass
class StepTensors:
    """One step's checked inputs on their device: float64 log-probs, bool mask, int64 ids."""
    s: torch.Tensor  # [B, T] float64
    t: torch.Tensor  # [B, T] float64
    mask: torch.Tensor  # [B, T] bool
    samples: torch.Tensor  # [B] int64 sequence ids
    token_ids: torch.Tensor | None  # [B, T]
    sampler_version: torch.Tensor | None  # [B, T] int64
    trainer_version: torch.Tensor | None
    sampler_experts: torch.Tensor | None  # [B, T, L, K]
    trainer_experts: torch.Tensor | None
    sampler_weights: torch.Tensor | None = None  # [B, T, L, K] router combine weights (floats), experts' order
    trainer_weights: torch.Tensor | None = None
    topk: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # [B, T, J] ids, log-probs
    #                                                       of the sampler, then the trainer (log-probs float64)
    segments: torch.Tensor | None = None  # [B, T] int64 turn index (0 at padding), for the residual counts
    margins: dict[str, torch.Tensor | None] | None = None  # side -> [B, T, L] router margins (record/margins.py)
    routing_in_pass: bool = False  # expert ids and weights are left to the CPU routing pass to check

    @property
    def device(self) -> torch.device:
        return self.s.device


def _series_k3_pair(d: torch.Tensor, d2: torch.Tensor, even: torch.Tensor,
                    odd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^d − 1 − d, e^−d − 1 + d) by their Taylor series to d^8 (compute.series_k3_sql's terms), from d and
    d² = d·d: the even powers E and the odd powers O are summed once (Horner in d², one fused c + E·d² pass per
    coefficient), k3 = E + O and k3r = E − O (|O| < |E|/100 below SERIES_BELOW, so neither cancels; they
    differ from the SQL's Horner order by a few ulps). Written into `odd` (k3) and `even` (k3r)."""
    def c(x: float) -> torch.Tensor:
        return torch.tensor(x, dtype=d.dtype, device=d.device)
    torch.add(c(1.0 / 720), d2, alpha=1.0 / 40320, out=even)
    torch.addcmul(c(1.0 / 24), even, d2, out=even)
    torch.addcmul(c(0.5), even, d2, out=even).mul_(d2)  # E = d²/2! + d⁴/4! + d⁶/6! + d⁸/8!
    torch.add(c(1.0 / 120), d2, alpha=1.0 / 5040, out=odd)
    torch.addcmul(c(1.0 / 6), odd, d2, out=odd).mul_(d2).mul_(d)  # O = d³/3! + d⁵/5! + d⁷/7!
    odd.add_(even)
    even.mul_(2.0).sub_(odd)  # 2E − (E + O) = E − O
    return odd, even


@dataclass
class Terms:
    """The per-position terms of a block of rows: V[WIDE index] sums, X[EXTREMES index] maxima."""
    V: torch.Tensor  # [len(WIDE), *shape]: 0 at padding
    X: torch.Tensor  # [len(EXTREMES), *shape]: −inf at padding

    def sum_row(self, name: str) -> torch.Tensor:
        return self.V[_W[name]]


class Workspace:
    """Buffers of the term blocks, reused from chunk to chunk and step to step: writing into fresh pages (the
    allocator maps blocks this large anew each time) measured costlier than the arithmetic itself."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A contiguous tensor of `shape` (contents undefined), on storage kept under `name`."""
        n = math.prod(shape)
        buf = self._buffers.get((name, dtype, device))
        if buf is None or buf.numel() < n:
            buf = self._buffers[(name, dtype, device)] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)


def token_terms(s: torch.Tensor, t: torch.Tensor, mask: torch.Tensor | None = None,
                work: Workspace | None = None) -> Terms:
    """Per-position terms of summaries/schema.py for float64 s, t of any shape; where `mask` is False (padding,
    any value there, NaN included) every sum term is 0 and every extreme −inf."""
    work = work or Workspace()
    shape, dev, f64 = s.shape, s.device, torch.float64

    def buf(name: str, dtype=f64) -> torch.Tensor:
        return work.get(name, tuple(shape), dtype, dev)
    V = work.get("V", (len(WIDE),) + tuple(shape), f64, dev)
    X = work.get("X", (len(EXTREMES),) + tuple(shape), f64, dev)
    r = {c: V[j] for c, j in _W.items()}
    full = mask is None or bool(mask.all())
    if full:
        r["n_tokens"].fill_(1.0)
    else:  # s = t = 0 makes every term 0 but the probabilities exp s, exp t, masked below
        zero = torch.zeros((), dtype=f64, device=dev)
        s, t = torch.where(mask, s, zero, out=buf("s")), torch.where(mask, t, zero, out=buf("t"))
        r["n_tokens"].copy_(mask)
    # compute.token_terms_sql's forms: two expm1 per token, the other terms from them without cancellation
    d = torch.sub(t, s, out=r["sum_d"])
    abs_d = torch.abs(d, out=r["sum_abs_d"])
    clamped = bool(abs_d.max() > S.CLAMP) if d.numel() else False  # cd = d unless some |Δ| > CLAMP
    cd = torch.clamp(d, -S.CLAMP, S.CLAMP, out=buf("cd")) if clamped else d
    rm1 = torch.expm1(cd, out=r["sum_rm1"])
    em = torch.neg(cd, out=buf("em")).expm1_()  # expm1(−cd) = 1/r − 1 (the SQL's −(r − 1)/r, to an ulp)
    d2 = torch.mul(d, d, out=r["sum_d2"])
    small = torch.lt(abs_d, S.SERIES_BELOW, out=buf("small", torch.bool))
    k3_series, k3r_series = _series_k3_pair(d, d2, buf("even"), buf("odd"))
    k3 = torch.sub(rm1, d, out=r["sum_k3"]).clamp_(min=0.0)
    torch.where(small, k3_series, k3, out=k3)
    k3r = torch.add(em, d, out=r["sum_k3r"]).clamp_(min=0.0)
    torch.where(small, k3r_series, k3r, out=k3r)
    torch.mul(rm1, rm1, out=r["sum_rm1_sq"])
    torch.maximum(rm1, em, out=r["sum_mpe"])  # expm1(|cd|): the non-negative one of r − 1 and 1/r − 1
    ps, pt = torch.exp(s, out=r["sum_ps"]), torch.exp(t, out=r["sum_pt"])
    if not full:
        ps.mul_(r["n_tokens"])
        pt.mul_(r["n_tokens"])
    dp = torch.mul(ps, rm1, out=buf("dp"))  # exp t − exp s = exp s · (r − 1) while Δ is not clamped
    if clamped:
        torch.where(d == cd, dp, pt - ps, out=dp)
    qs = torch.expm1(s, out=r["sum_qs"]).neg_()
    qt = torch.sub(qs, dp, out=r["sum_qt"])
    adp = torch.abs(dp, out=r["sum_adp"])
    torch.mul(qs, qs, out=r["sum_qs2"])
    torch.mul(qt, qt, out=r["sum_qt2"])
    torch.mul(qs, qt, out=r["sum_qsqt"])
    torch.mul(ps, ps, out=r["sum_ps2"])
    torch.mul(pt, pt, out=r["sum_pt2"])
    torch.mul(ps, pt, out=r["sum_pspt"])
    for name, value in (("max_d", d), ("max_adp", adp), ("max_s", s), ("max_t", t)):
        X[_X[name]].copy_(value)
    for name, value in (("min_d", d), ("min_s", s), ("min_t", t)):
        torch.neg(value, out=X[_X[name]])
    if not full:
        X.masked_fill_(~mask, -math.inf)
    return Terms(V, X)


def bin_of(x: torch.Tensor, edges: tuple[float, ...]) -> torch.Tensor:
    """The schema's bin id 2·#{E < x} + 𝟙[x on an edge] of each x (int64)."""
    e = torch.tensor(edges, dtype=torch.float64, device=x.device)
    below = torch.searchsorted(e, x)  # left: #{E < x}
    on_edge = e[below.clamp(max=len(edges) - 1)] == x
    return below.mul_(2).add_(on_edge)


def _band_of_bin(device: torch.device) -> torch.Tensor:
    """band (on BAND_EDGES) of each fine Δ bin (on D_EDGES): one value per bin, since BAND_EDGES ⊂ D_EDGES."""
    return torch.from_numpy(kernel.BAND_OF_BIN).to(device)


def position_bucket(pos: torch.Tensor) -> torch.Tensor:
    """compute.bucket_sql('position'): 0 for pos 0, else floor(log2 pos) + 1 (the bit length of pos)."""
    return torch.searchsorted(2 ** torch.arange(62, device=pos.device), pos, right=True)


def prob_bucket(s: torch.Tensor) -> torch.Tensor:
    """compute.bucket_sql('prob'), the same arithmetic: clamp(floor((s / ln 10 − PROB_LO) / PROB_WIDTH))."""
    return ((s / math.log(10) - S.PROB_LO) / S.PROB_WIDTH).floor_().clamp_(0, S.PROB_BINS - 1).to(torch.int64)


class _Acc:
    """Sums (WIDE, or the NARROW first rows) and maxima (EXTREMES) of groups [0, n), accumulated chunk by
    chunk: merging is addition and max."""

    def __init__(self, n: int, device: torch.device, narrow: bool = False):
        self.sums = torch.zeros(len(NARROW if narrow else WIDE), n, dtype=torch.float64, device=device)
        self.top = None if narrow else torch.full((len(EXTREMES), n), -math.inf, dtype=torch.float64,
                                                  device=device)

    def scatter(self, index: torch.Tensor, V: torch.Tensor, X: torch.Tensor | None = None) -> None:
        """Add column j of V [rows, m] to group index[j] (and the same for the maxima of X)."""
        self.sums.scatter_add_(1, index.expand(len(self.sums), -1), V[:len(self.sums)])
        if self.top is not None:
            self.top.scatter_reduce_(1, index.expand(len(self.top), -1), X, "amax")

    def rows(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(ids of the non-empty groups, column -> value per such group)."""
        return _rows(self.sums, self.top)


def _rows(sums: torch.Tensor, top: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Columns of the non-empty groups of a [WIDE or NARROW, n] block of sums and its [EXTREMES, n] maxima."""
    ids = sums[0].nonzero().squeeze(1)
    kept = sums[:, ids]  # one gather of the non-empty columns, then row views
    out = {"n_tokens": kept[0].to(torch.int64)}  # exact: a float64 count of < 2^53 tokens
    out |= {c: kept[j] for j, c in enumerate(WIDE[1:len(sums)], 1)}
    if top is not None:
        hi = top[:, ids]
        out |= {c: hi[j].neg() if c.startswith("min_") else hi[j] for c, j in _X.items()}
        out[DERIVED] = torch.maximum(hi[_X["max_d"]], hi[_X["min_d"]])  # max |d| = max(max d, −min d)
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
    weighted = both and x.sampler_weights is not None and x.trainer_weights is not None
    if weighted:  # METRICS.md v3 weight_abs_diff over the rows whose two expert sets are equal
        sw_all = x.sampler_weights.reshape(B * T, L, K)
        tw_all = x.trainer_weights.reshape(B * T, L, K)
        n_w = torch.zeros(L, dtype=torch.int64, device=dev)
        sum_w = torch.zeros(L, dtype=torch.float64, device=dev)
        max_w = torch.full((L,), -math.inf, dtype=torch.float64, device=dev)
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
        if weighted:
            d = weight_diff(se, te, sw_all[rows].to(torch.float64), tw_all[rows].to(torch.float64))  # [c, L]
            same = ~flip
            n_w += same.sum(0)
            sum_w += torch.where(same, d, 0.0).sum(0)
            torch.maximum(max_w, torch.where(same, d, -math.inf).amax(0), out=max_w)
    layer_rows = _layer_rows(L, K, n, both, [v.tolist() for v in (n_flip, n_top1, common, first)] if both else None,
                             (n_w.tolist(), sum_w.tolist(), max_w.tolist()) if weighted else None)
    expert_load = _expert_load(load, L, n_experts)
    return _Routing(flipped_layers if both else None, layer_rows, expert_load)


def _host(values: dict[str, torch.Tensor | list]) -> dict[str, np.ndarray | list]:
    """Columns to the host as numpy arrays (Arrow takes them without a copy; lists of Python floats are slow)."""
    return {k: v.cpu().numpy() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


@dataclass
class _Lags:
    """trainer_version − sampler_version of the trained tokens: one per row when both versions are per
    sequence (or one int), the usual case, else per position."""
    lo: int  # smallest lag of a trained token
    n: int  # lags lo .. lo + n − 1
    per_row: torch.Tensor | None  # [B] lag − lo
    per_token: torch.Tensor | None  # [B, T] lag − lo
    # (both clamped into [0, n): a row or position without trained tokens adds nothing wherever it goes)

    @staticmethod
    def of(x: StepTensors) -> "_Lags | None":
        sv, tv = x.sampler_version, x.trainer_version
        if sv is None or tv is None:
            return None
        if sv.stride(1) == 0 and tv.stride(1) == 0:  # broadcast from [B] or an int: one lag per row
            lag = tv[:, 0] - sv[:, 0]
            trained = lag[x.mask.any(1)]
        else:
            lag = tv - sv
            trained = lag[x.mask]
        if not len(trained):
            return None
        lo, hi = int(trained.min()), int(trained.max())
        lag = (lag - lo).clamp_(0, hi - lo)
        return _Lags(lo, hi - lo + 1, lag, None) if lag.ndim == 1 else _Lags(lo, hi - lo + 1, None, lag)



def _cat(parts: list[dict]) -> dict:
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]} if parts else {}


def _bucket_rows(dim: str, ids: torch.Tensor, rows: dict, offset: int = 0) -> dict:
    return _host({"dim": np.full(len(ids), dim, dtype=object), "bucket": ids + offset} | rows)


def _band_rows(dim: str, block: torch.Tensor, offset: int = 0) -> dict:
    """summary_bucket_band rows of a [NARROW, buckets, N_BANDS] block of sums."""
    ids, rows = _rows(block.reshape(len(NARROW), -1), None)
    return _host({"dim": np.full(len(ids), dim, dtype=object), "bucket": ids // S.N_BANDS + offset,
                  "band": ids % S.N_BANDS} | rows)


def seq_logprob_sums(x: StepTensors, samples: np.ndarray, per_row: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """schema.SEQ_SUMS of the sequences `samples` (ids of x.samples): n_lp_tokens, Σ s, Σ t, Σ log cosh(Δ/2)
    (as kernel.log_cosh_half) and Σ r·t, r = exp(clamp(Δ, ±20)), over each row's trained positions. per_row: the
    [5, B] sums the kernel's pass took (`_kernel_tables`), else torch ops over the tensors."""
    cols = per_row if per_row is not None else _row_seq_sums_torch(x)
    ids = x.samples.cpu().numpy()
    order = np.argsort(ids, kind="stable")
    rows = order[np.searchsorted(ids[order], samples)]
    return {"n_lp_tokens": cols[0, rows].astype(np.int64)} | dict(zip(S.SEQ_SUM_NAMES[1:], cols[1:, rows]))


def _row_seq_sums_torch(x: StepTensors) -> np.ndarray:
    """[5, B] per row: the trained token count and schema.SEQ_SUMS, by torch ops on the tensors' device."""
    m = x.mask
    zero = torch.zeros((), dtype=torch.float64, device=x.device)
    d = torch.where(m, x.t - x.s, zero)  # padding may hold anything
    h = (0.5 * d).abs()
    js = torch.where(h < 1.0, torch.log1p(2.0 * torch.sinh(0.5 * h) ** 2),
                     h + torch.log1p(torch.exp(-2.0 * h)) - math.log(2.0))
    r = torch.exp(d.clamp(-S.CLAMP, S.CLAMP))
    t = torch.where(m, x.t, zero)
    return torch.stack([m.sum(1, dtype=torch.float64), torch.where(m, x.s, zero).sum(1), t.sum(1),
                        torch.where(m, js, zero).sum(1), (r * t).sum(1)]).cpu().numpy()


def summarise(x: StepTensors, kept: Kept, plan: SamplePlan, work: Workspace | None = None,
              engine: str = "auto") -> dict[str, dict[str, list]]:
    """Summary table name -> the step's rows of that table, as columns (no run/step/file_id).

    engine: "kernel" reduces the tokens in one pass of analysis/summaries/kernel.py (CPU tensors only),
    "torch" with torch ops on the tensors' device; "auto" (the default) takes the kernel on the CPU and torch
    elsewhere. Both give the same rows (to a few ulps; tests/test_summary_kernel.py)."""
    B, T = x.mask.shape
    dev = x.device
    if engine == "auto":
        engine = "kernel" if dev.type == "cpu" else "torch"
    if engine not in ("kernel", "torch"):
        raise ValueError(f"engine: expected 'auto', 'kernel' or 'torch', got {engine!r}")
    tables: dict[str, dict] = {SAMPLE_TABLE: sample_record(kept, plan)}
    routing = flipped = None
    if x.sampler_experts is not None and engine == "kernel":  # one numba pass, flipped layers per position
        routing = _routing_cpu(x)
        flipped = routing.n_flipped_layers
    elif x.sampler_experts is not None:
        flat = x.mask.reshape(-1).nonzero().squeeze(1)  # the trained tokens, row-major
        routing = _routing(x, flat)
        if routing.n_flipped_layers is not None:  # flipped layers per position (0 at padding)
            flipped = torch.zeros(B * T, dtype=torch.int64, device=dev)
            flipped[flat] = routing.n_flipped_layers
            flipped = flipped.view(B, T)
    lags = _Lags.of(x)
    seq_sums = None  # [5, B]: schema.SEQ_SUMS per row, taken by the kernel's pass
    if engine == "kernel":
        seq_sums = np.zeros((5, B))
        tables |= _kernel_tables(x, lags, flipped, seq_sums)
    else:
        tables |= _torch_tables(x, lags, flipped, work or Workspace())
    if tables["summary_step"]:  # the logging checks' sums (schema.CHECK_SUMS)
        space = work or Workspace()
        sums = check_sums(x.s, x.t, x.mask, lambda name, shape: space.get(name, shape, torch.float64, dev))
        tables["summary_step"] |= {k: [v] for k, v in sums.items()}
        tables["summary_step"] |= {k: [v] for k, v in residual_sums(x.s, x.t, x.mask, x.segments).items()}
        if x.topk is not None:  # the full-distribution sums (schema.TOPK_SUMS), per sequence and the step's total
            per_row = np.zeros((B, fulldist.N_SUMS))
            sums = topk_sums(*x.topk, x.mask, pool=_pool(), per_row=per_row) if engine == "kernel" else \
                topk_sums_torch(*x.topk, x.mask, per_row=per_row)
            tables["summary_step"] |= {k: [v] for k, v in sums.items()}
            tables["summary_seq"] |= seq_topk_columns(per_row, x.samples.cpu().numpy(),
                                                      np.asarray(tables["summary_seq"]["sample"]))
    if tables["summary_seq"]:
        tables["summary_seq"] |= seq_logprob_sums(x, np.asarray(tables["summary_seq"]["sample"]), seq_sums)
    if routing is not None:
        tables["summary_layer"] = routing.layer_rows
        tables[EXPERT_LOAD] = routing.expert_load
        if x.margins and routing.layer_rows["layer"]:  # the router-margin sums (schema.MARGIN_SUMS, summary_margin)
            layer_cols, tables["summary_margin"] = margin_tables(x.s, x.t, x.mask, x.sampler_experts,
                                                                 x.trainer_experts, x.margins, pool=_pool())
            tables["summary_layer"] = tables["summary_layer"] | layer_cols
    return tables


def _layer_rows(L: int, K: int, n: int, both: bool, counts: list[list[int]] | None,
                weights: tuple[list[int], list[float], list[float]] | None) -> dict[str, list]:
    """summary_layer columns of a step's L layers from its routing counts (n_flip, n_top1, sum_common,
    n_first_flip per layer; None without the trainer's side) and weight sums (n, Σ d, max d; None without)."""
    zeros, nulls = [0] * L, [None] * L  # as ingest's SQL has them: count_if over no trainer side is NULL
    rows = {"layer": list(range(L)), "k": [K] * L, "n_rows": [n] * L, "n_both": [n if both else 0] * L,
            "n_flip": counts[0] if both else nulls, "n_top1": counts[1] if both else nulls,
            "sum_common": counts[2] if both else zeros, "n_first_flip": counts[3] if both else zeros}
    if weights is not None:
        rows |= {"n_weight_rows": weights[0], "sum_weight_abs_diff": weights[1],
                 "max_weight_abs_diff": [v if v > -math.inf else None for v in weights[2]]}
    return rows if n else {k: [] for k in rows}


def _expert_load(load: dict[str, torch.Tensor], L: int, n_experts: int) -> dict[str, list[int]]:
    """expert_load columns (layer, expert, n_sampler, n_trainer) of the experts some side routed to."""
    counts = {side: c.reshape(L, n_experts) for side, c in load.items()}
    seen = sum(counts.values()) > 0
    layer, expert = seen.nonzero().unbind(1)
    out = {"layer": layer.tolist(), "expert": expert.tolist()}
    out |= {side: c[layer, expert].tolist() for side, c in counts.items()}
    out.setdefault("n_trainer", [0] * len(layer))  # ingest counts 0 for a side not recorded
    return out


def _numpy_of(v: torch.Tensor) -> np.ndarray:
    return (v if v.dtype != torch.bfloat16 and v.dtype != torch.float16 else v.to(torch.float32)).numpy()


EXPERT_TABLE = 1024  # expert ids the CPU routing pass counts into its tables at first (more: it runs again)


def _routing_cpu(x: StepTensors) -> _Routing:
    """`_routing` on the CPU in one numba pass (summaries/fulldist.routing_pass), the positions shared among
    torch.get_num_threads() threads in pieces, each into counts of its own, added after; n_flipped_layers is then
    the [B, T] grid of flipped layers per position (0 at padding). The pass also checks the trained positions'
    expert ids (>= 0) and, where both sides' weights are given, weights (finite): DriftLogger leaves those checks
    to it on the CPU. Its tables hold EXPERT_TABLE ids per layer, or as many as the largest id needs (a second
    pass)."""
    B, T, L, K = x.sampler_experts.shape
    N = B * T
    se = x.sampler_experts.reshape(N, L, K)
    te = x.trainer_experts.reshape(N, L, K) if x.trainer_experts is not None else None
    both = te is not None
    weighted = both and x.sampler_weights is not None and x.trainer_weights is not None
    args = [_numpy_of(se.contiguous()), _numpy_of((te if both else se).contiguous()),  # the pass reads them flat
            _numpy_of(x.sampler_weights.reshape(N, L, K).contiguous()) if weighted else np.zeros((0, 0, 0), np.float32),
            _numpy_of(x.trainer_weights.reshape(N, L, K).contiguous()) if weighted else np.zeros((0, 0, 0), np.float32),
            x.mask.reshape(N).numpy()]
    piece = max(1, KERNEL_PIECE // max(1, L))
    threads = min(torch.get_num_threads(), max(1, N * L // KERNEL_SPLIT))
    cap = EXPERT_TABLE
    while True:
        flipped = np.zeros(N, np.int64)

        def start(_) -> list:  # a thread's counts and sums, then the status that stopped it
            return [np.zeros(L * cap, np.int64), np.zeros(L * cap, np.int64), np.zeros((5, L), np.int64),
                    np.zeros(L), np.full(L, -math.inf), (0, 0)]

        def step(state: list, lo: int, hi: int) -> bool:
            state[5] = fulldist.routing_pass(*args, lo, hi, both, weighted, *state[:5], flipped)
            return bool(state[5][0])
        states = in_pieces(N, piece, threads, _pool(), start, step)
        load_s, load_t, counts, w_sum, w_max, _ = states[0]
        statuses = [st[5] for st in states]
        for o in states[1:]:
            load_s += o[0]
            load_t += o[1]
            counts += o[2]
            w_sum += o[3]
            np.maximum(w_max, o[4], out=w_max)
        bad = [i for code, i in statuses if code == 1]
        if bad:
            b, p = divmod(min(bad), T)
            raise ValueError(routing_problem(b, p, x.sampler_experts, x.trainer_experts, x.sampler_weights,
                                             x.trainer_weights))
        wider = [e for code, e in statuses if code == 2]
        if not wider:
            break
        cap = max(2 * cap, max(wider) + 1)
    n = int(x.mask.sum())
    load = {"n_sampler": torch.from_numpy(load_s)} | ({"n_trainer": torch.from_numpy(load_t)} if both else {})
    rows = _layer_rows(L, K, n, both, counts[:4].tolist(),
                       (counts[4].tolist(), w_sum.tolist(), w_max.tolist()) if weighted else None)
    return _Routing(torch.from_numpy(flipped).view(B, T) if both else None, rows, _expert_load(load, L, cap))


KERNEL_SPLIT = 1 << 17  # positions per thread below which the kernel runs on one thread
KERNEL_PIECE = 1 << 16  # positions (whole rows) a kernel thread takes from the step at a time


_POOL = None


def _pool():
    """The threads that run the kernel's other parts, made on first use and kept (a pool per step cost
    ~4 ms of thread start-up per step)."""
    global _POOL
    if _POOL is None:
        from concurrent.futures import ThreadPoolExecutor
        _POOL = ThreadPoolExecutor(max(1, (os.cpu_count() or 2) - 1), thread_name_prefix="drift-summaries")
    return _POOL


def _kernel_tables(x: StepTensors, lags: "_Lags | None", flipped: torch.Tensor | None,
                   seq_sums: np.ndarray) -> dict[str, dict]:
    """The token summary tables by the one-pass kernel, over the step's [B, T] tensors in grid form (numpy
    views of the CPU tensors, no copy). With torch.get_num_threads() > 1, that many threads (the kernel
    releases the GIL) take pieces of KERNEL_PIECE positions of whole rows, each the next one left, into
    accumulators of their own, merged after: a thread slowed by other work on its core takes fewer pieces, where
    fixed halves left the other waiting (a step of 1M positions on 2 threads: 35 ms, of which each half
    27 ms). seq_sums ([5, B], zeros): receives each row's schema.SEQ_SUMS in the same pass (the threads' rows
    are disjoint)."""
    B, T = x.mask.shape
    if x.device.type != "cpu":
        raise ValueError(f"the summary kernel runs on CPU tensors, these are on {x.device}")

    def flat(v: torch.Tensor) -> np.ndarray:
        return v.contiguous().numpy().reshape(-1)
    args = dict(s=flat(x.s), t=flat(x.t), valid=flat(x.mask), T=T,
                flipped=flat(flipped) if flipped is not None else None, seq_sums_out=seq_sums)
    n_lag = 0
    if lags is not None:
        n_lag = lags.n
        if lags.per_row is not None:
            args["seq_lag"] = flat(lags.per_row)
        else:
            args["tok_lag"] = flat(lags.per_token)
    threads = min(torch.get_num_threads(), B, max(1, B * T // KERNEL_SPLIT))
    # the threads take whole sequences, so they share the sequence arrays and merge only their bucket sums
    accs = [kernel.Accumulators.zeros(B, n_lag)]
    accs += [accs[0].sharing_sequences() for _ in range(threads - 1)]
    if threads == 1:
        accs[0].add(**args)
    else:  # one thread is this one, the others the pool's (started once per process)
        rows = max(1, KERNEL_PIECE // T)

        def step(acc: kernel.Accumulators, first: int, last: int) -> None:
            acc.add(**args, lo=first * T, hi=last * T)
        in_pieces(B, rows, threads, _pool(), lambda i: accs[i], step)
    acc = accs[0]
    for other in accs[1:]:
        acc = acc.merge(other)
    return kernel.tables(acc, x.samples.numpy(), lags.lo if lags is not None else 0, n_lag,
                         routed=flipped is not None)


def _torch_tables(x: StepTensors, lags: "_Lags | None", flipped: torch.Tensor | None,
                  work: Workspace) -> dict[str, dict]:
    """The token summary tables by torch ops on the tensors' device.

    Tokens are reduced in chunks of whole rows (about CHUNK_TOKENS positions), which bounds the temporaries
    whatever the step's size; a sequence's rows are complete within its chunk."""
    B, T = x.mask.shape
    dev = x.device
    NB, nW = S.N_BANDS, len(WIDE)
    tables: dict[str, dict] = {}
    pos_bucket = position_bucket(torch.arange(T, device=dev))  # [T]
    n_pos = int(pos_bucket[-1]) + 1 if T else 1
    band_of_bin = _band_of_bin(dev)
    prob = _Acc(S.PROB_BINS, dev)
    cells = _Acc(S.N_BINS * S.PROB_BINS * n_pos, dev, narrow=True)  # joint (Δ bin, prob, position bucket)
    # position bucket k holds the positions [2^(k−1), 2^k) (k = 0: position 0), a contiguous range of columns
    ranges = [(0 if k == 0 else 1 << (k - 1), min(T, 1 << k)) for k in range(n_pos)]
    pos_wide = torch.zeros(nW, n_pos, dtype=torch.float64, device=dev)
    pos_max = torch.full((len(EXTREMES), n_pos), -math.inf, dtype=torch.float64, device=dev)
    if lags is not None:
        lag_wide, lag_band = _Acc(lags.n, dev), _Acc(lags.n * NB, dev, narrow=True)
    positions = torch.arange(T, device=dev)
    seq_parts, band_parts, flip_parts = [], [], []
    rows_per_chunk = max(1, CHUNK_TOKENS // max(T, 1))
    for r0 in range(0, B, rows_per_chunk):
        r1 = min(B, r0 + rows_per_chunk)
        m = x.mask[r0:r1]
        if not bool(m.any()):
            continue
        b = r1 - r0
        terms = token_terms(x.s[r0:r1], x.t[r0:r1], m, work)
        V, X = terms.V, terms.X
        # one pass over the block: each row's sums and maxima per position bucket, from which both the
        # sequence rows and the position buckets follow
        part_sums = torch.stack([V[:, :, lo:hi].sum(-1) for lo, hi in ranges], -1)  # [WIDE, b, n_pos]
        part_top = torch.stack([X[:, :, lo:hi].amax(-1) for lo, hi in ranges], -1)
        row_sums, row_top = part_sums.sum(-1), part_top.amax(-1)  # [WIDE, b], [EXTREMES, b]
        ids, seq = _rows(row_sums, row_top)
        seq["max_pos"] = torch.where(m, positions, -1).amax(1)[ids]
        seq["sample"] = x.samples[r0 + ids]
        # the band split: (sequence, band) cells, and the joint (Δ bin, prob, position bucket) cells
        dbin = bin_of(terms.sum_row("sum_d"), S.D_EDGES)
        band = band_of_bin[dbin]
        narrow = V[:len(NARROW)].reshape(len(NARROW), -1)
        seq_band = torch.zeros(len(NARROW), b * NB, dtype=torch.float64, device=dev)
        seq_band.scatter_add_(1, (band + (torch.arange(b, device=dev) * NB)[:, None]).view(1, -1)
                              .expand(len(NARROW), -1), narrow)
        band_ids, band_rows = _rows(seq_band, None)
        band_parts.append({"sample": x.samples[r0 + band_ids // NB], "band": band_ids % NB} | band_rows)
        pb = prob_bucket(X[_X["max_s"]])  # s at trained positions, −inf (bucket 0) at padding
        cells.scatter(((dbin * S.PROB_BINS + pb) * n_pos + pos_bucket).view(1, -1), narrow)
        # prob buckets: a scatter of each position's terms but the NARROW ones, which are marginals of the joint
        # cells (position buckets came from part_sums above)
        k = len(NARROW)
        prob.sums[k:].scatter_add_(1, pb.view(1, -1).expand(nW - k, -1), V[k:].view(nW - k, -1))
        prob.top.scatter_reduce_(1, pb.view(1, -1).expand(len(EXTREMES), -1), X.view(len(EXTREMES), -1), "amax")
        pos_wide += part_sums.sum(1)
        torch.maximum(pos_max, part_top.amax(1), out=pos_max)
        if lags is not None and lags.per_row is not None:  # group the rows by their lag
            lag = lags.per_row[r0:r1]
            lag_wide.sums.index_add_(1, lag, row_sums)
            lag_wide.top.scatter_reduce_(1, lag.expand(len(EXTREMES), -1), row_top, "amax")
            lag_band.sums.view(len(NARROW), lags.n, NB).index_add_(1, lag, seq_band.view(len(NARROW), b, NB))
        elif lags is not None:
            lag = lags.per_token[r0:r1]
            lag_wide.scatter(lag.reshape(1, -1), V.view(nW, -1), X.view(len(EXTREMES), -1))
            lag_band.scatter((lag * NB + band).view(1, -1), narrow)
        if flipped is not None:
            fl_layers = flipped[r0:r1]
            fl = fl_layers > 0
            seq["n_flip_tokens"] = fl.sum(1)[ids]
            abs_d, k3 = terms.sum_row("sum_abs_d"), terms.sum_row("sum_k3")  # 0 at padding
            zero = torch.zeros((), dtype=torch.float64, device=dev)
            flip_parts.append({"n_any_flip": fl.sum(), "sum_flipped_layers": fl_layers.sum(),
                               "sum_abs_d_flip": torch.where(fl, abs_d, zero).sum(),
                               "sum_k3_flip": torch.where(fl, k3, zero).sum(),
                               "sum_abs_d_noflip": torch.where(fl, zero, abs_d).sum(),
                               "sum_k3_noflip": torch.where(fl, zero, k3).sum()})
        seq_parts.append(seq)

    seq = _cat(seq_parts)
    tables["summary_seq"] = _host(seq)
    tables["summary_seq_band"] = _host(_cat(band_parts))
    tables["summary_step"] = _step_row(seq, flip_parts, int(x.mask.sum()) if flipped is not None else 0)
    narrow_cells = cells.sums.view(len(NARROW), S.N_BINS, S.PROB_BINS, n_pos)

    def by_band(block: torch.Tensor) -> torch.Tensor:  # [NARROW, N_BINS, k] -> [NARROW, k, N_BANDS]
        out = torch.zeros(len(NARROW), NB, block.shape[-1], dtype=torch.float64, device=dev)
        return out.index_add_(1, band_of_bin, block).transpose(1, 2)
    bins, hist = _rows(narrow_cells.sum((2, 3)), None)
    tables["summary_hist"] = _host({"bin": bins} | hist)
    prob.sums[:len(NARROW)] = narrow_cells.sum((1, 3))
    wide = [_bucket_rows("prob", *prob.rows()), _bucket_rows("position", *_rows(pos_wide, pos_max))]
    banded = [_band_rows("prob", by_band(narrow_cells.sum(3))), _band_rows("position", by_band(narrow_cells.sum(2)))]
    if lags is not None:
        wide.append(_bucket_rows("lag", *lag_wide.rows(), offset=lags.lo))
        banded.append(_band_rows("lag", lag_band.sums.view(len(NARROW), lags.n, NB), offset=lags.lo))
    tables["summary_bucket"] = {k: np.concatenate([p[k] for p in wide]) for k in wide[0]}
    tables["summary_bucket_band"] = {k: np.concatenate([p[k] for p in banded]) for k in banded[0]}
    return tables


def _step_row(seq: dict, flip_parts: list[dict], n_routed: int) -> dict[str, list]:
    """The step's summary_step row, reduced from its sequence rows (none for a step without trained tokens)."""
    if not seq:
        return {}
    row = {"n_tokens": [int(seq["n_tokens"].sum())]}
    row |= {c: [float(seq[c].sum())] for c in WIDE[1:]}
    row |= {c: [float(seq[c].min() if c.startswith("min_") else seq[c].max())] for c in EXTREMES + [DERIVED]}
    if flip_parts:
        row |= {"n_routed": [n_routed]}
        row |= {k: [sum(p[k] for p in flip_parts).item()] for k in flip_parts[0]}
    return row


def sample_record(kept: Kept, plan: SamplePlan) -> dict[str, list]:
    """One row saying what the step's token rows are: the summaries cover n_tokens, the rows hold n_kept."""
    return {"token_sample": [float(plan.rate)], "worst_sequences": [plan.worst_sequences],
            "top_tokens": [plan.top_tokens], "n_tokens": [kept.n_tokens], "n_kept": [kept.n_kept],
            "n_uniform": [kept.n_uniform], "n_worst_seq_tokens": [kept.n_worst_sequence_tokens],
            "n_top_tokens": [kept.n_top_tokens]}


__all__ = ["StepTensors", "Workspace", "summarise", "token_terms", "bin_of", "SUMMARISED_KEY", "SAMPLE_TABLE", "EXPERT_LOAD"]
