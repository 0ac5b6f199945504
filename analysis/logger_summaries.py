"""The summaries DriftLogger writes for each step, reduced with torch on the device the tensors are on.

They are the rows of the summary tables (analysis/summaries/schema.py) that ingest would compute from the
step's tokens and routing (analysis/summaries/compute.py), so a trainer can write a sample of its tokens while
every view above token level stays exact. The per-token terms follow compute.py's definitions; reductions are
float64 (inputs are widened first), with no Python loop per token or sequence; only reduced rows leave the device.

Grouping: one pass groups tokens by (sequence, ratio band), the summary_seq rows; the step row is reduced from
those rows. Δ bins and the (bucket, band) rows of each bucket dimension are one pass each. A group's sums are
`torch.bincount` with weights (one pass per column), its minima and maxima one `scatter_reduce` over the
stacked columns (minima as maxima of the negated value, which is exact).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pyarrow as pa
import torch

from analysis.summaries import schema as S
from analysis.token_sample import Kept, SamplePlan

SUMMARY_KEY = "driftscope.summary"  # schema metadata of a summary file: the tables its rows belong to
SUMMARY_COLUMN = "summary"  # in a summary file, the table each row belongs to
SUMMARISED_KEY = S.SUMMARISED_KEY.decode()  # "1" on token/routing files whose summaries come in a summary file
SAMPLE_TABLE = "summary_sample"  # per (run, step): what the step's token rows are a sample of
EXPERT_LOAD = "expert_load"  # per (run, step, layer, expert) routed-token counts, as ingest aggregates them
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
        inner = 1.0 / c + x * inner
    return x * x * inner


def token_terms(s: torch.Tensor, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token terms of summaries/schema.py for 1-D float64 s, t: name -> value per token."""
    d = t - s
    cd = d.clamp(-S.CLAMP, S.CLAMP)
    rm1 = torch.expm1(cd)
    small = d.abs() < S.SERIES_BELOW
    k3 = torch.where(small, _series_k3(d), (rm1 - d).clamp(min=0.0))
    k3r = torch.where(small, _series_k3(-d), (torch.expm1(-cd) + d).clamp(min=0.0))
    qs, qt = -torch.expm1(s), -torch.expm1(t)
    abs_d = d.abs()
    adp = (qs - qt).abs()
    return {
        "sum_d": d, "sum_d2": d * d, "sum_abs_d": abs_d, "sum_k3": k3, "sum_k3r": k3r, "sum_rm1": rm1,
        "sum_rm1_sq": rm1 * rm1, "sum_mpe": torch.expm1(cd.abs()), "sum_adp": adp, "sum_qs": qs, "sum_qt": qt,
        "sum_qs2": qs * qs, "sum_qt2": qt * qt, "sum_qsqt": qs * qt,
        # extremes, each as a value whose maximum is wanted (minima negated)
        "max_abs_d": abs_d, "min_d": -d, "max_d": d, "max_adp": adp, "min_s": -s, "max_s": s, "min_t": -t,
        "max_t": t,
    }


def bin_of(x: torch.Tensor, edges: tuple[float, ...]) -> torch.Tensor:
    """The schema's bin id 2·#{E < x} + 𝟙[x on an edge] of each x (int64)."""
    e = torch.tensor(edges, dtype=torch.float64, device=x.device)
    below = torch.searchsorted(e, x)  # left: #{E < x}
    on_edge = e[below.clamp(max=len(edges) - 1)] == x
    return 2 * below + on_edge


def _grouped(index: torch.Tensor, n_groups: int, terms: dict[str, torch.Tensor], sums, maxes,
             extra_max: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(ids of the non-empty groups, name -> per-group value) for the token terms reduced by `index`."""
    n = torch.bincount(index, minlength=n_groups)
    ids = n.nonzero().squeeze(1)
    out = {"n_tokens": n[ids]}
    for name in sums:
        out[name] = torch.bincount(index, weights=terms[name], minlength=n_groups)[ids]
    cols = list(maxes) + list(extra_max or {})
    if cols:
        values = torch.stack([terms[c] for c in maxes] + list((extra_max or {}).values()), 1)
        top = torch.full((n_groups, len(cols)), -math.inf, dtype=torch.float64, device=index.device)
        top.scatter_reduce_(0, index[:, None].expand(-1, len(cols)), values, "amax")
        top = top[ids]
        for j, name in enumerate(cols):
            out[name] = -top[:, j] if name.startswith("min_") else top[:, j]
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


def _host(values: dict[str, torch.Tensor | list]) -> dict[str, list]:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def summarise(run: str, step: int, x: StepTensors, kept: Kept, plan: SamplePlan) -> dict[str, dict[str, list]]:
    """Summary table name -> the step's rows of that table, as columns (no run/step/file_id)."""
    B, T = x.mask.shape
    flat = x.mask.reshape(-1).nonzero().squeeze(1)  # the trained tokens, row-major
    b, pos = flat // T, flat % T
    s, t = x.s.reshape(-1)[flat], x.t.reshape(-1)[flat]
    terms = token_terms(s, t)
    d = terms["max_d"]
    band = bin_of(d, S.BAND_EDGES)
    tables: dict[str, dict] = {SAMPLE_TABLE: sample_record(kept, plan)}
    routing = _routing(x, flat) if x.sampler_experts is not None else None
    flipped = routing.n_flipped_layers if routing is not None else None

    # sequences × band; the step row is reduced from them
    ids, seq = _grouped(b * S.N_BANDS + band, B * S.N_BANDS, terms, _SUMS, _MAXES,
                        {"max_pos": pos.to(torch.float64)})
    if flipped is not None:
        seq["n_flip_tokens"] = torch.bincount((b * S.N_BANDS + band)[flipped > 0], minlength=B * S.N_BANDS)[ids]
    seq["max_pos"] = seq["max_pos"].to(torch.int64)
    step_row = {}
    if len(ids):
        step_row = {"n_tokens": [int(seq["n_tokens"].sum())]}
        step_row |= {c: [float(seq[c].sum())] for c in _SUMS}
        step_row |= {c: [float(seq[c].min() if c.startswith("min_") else seq[c].max())] for c in _MAXES}
        if flipped is not None:
            flip_tok = flipped > 0
            step_row |= {"n_routed": [len(flipped)], "n_any_flip": [int(flip_tok.sum())],
                         "sum_flipped_layers": [int(flipped.sum())],
                         "sum_abs_d_flip": [float(terms["sum_abs_d"][flip_tok].sum())],
                         "sum_k3_flip": [float(terms["sum_k3"][flip_tok].sum())],
                         "sum_abs_d_noflip": [float(terms["sum_abs_d"][~flip_tok].sum())],
                         "sum_k3_noflip": [float(terms["sum_k3"][~flip_tok].sum())]}
    tables["summary_step"] = step_row
    tables["summary_seq"] = _host({"sample": x.samples[ids // S.N_BANDS], "band": ids % S.N_BANDS} | seq)

    bins, hist = _grouped(bin_of(d, S.D_EDGES), S.N_BINS, terms, ("sum_rm1", "sum_rm1_sq"), ())
    tables["summary_hist"] = _host({"bin": bins} | hist)

    buckets = {"prob": (torch.floor((s / math.log(10) - S.PROB_LO) / S.PROB_WIDTH)
                        .clamp(0, S.PROB_BINS - 1).to(torch.int64)),
               "position": torch.searchsorted(2 ** torch.arange(31, device=pos.device), pos, right=True)}
    if x.sampler_version is not None and x.trainer_version is not None:
        buckets["lag"] = (x.trainer_version - x.sampler_version).reshape(-1)[flat]
    parts = []
    for dim, bucket in buckets.items():
        values, inverse = torch.unique(bucket, return_inverse=True)  # lags may be negative or large
        ids, rows = _grouped(inverse * S.N_BANDS + band, len(values) * S.N_BANDS, terms, _SUMS, _MAXES)
        parts.append({"dim": [dim] * len(ids), "bucket": values[ids // S.N_BANDS], "band": ids % S.N_BANDS} | rows)
    tables["summary_bucket"] = {k: sum((_host(p)[k] for p in parts), []) for k in parts[0]}
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


__all__ = ["StepTensors", "summarise", "token_terms", "bin_of", "SUMMARY_KEY", "SUMMARY_COLUMN", "SUMMARISED_KEY",
           "SAMPLE_TABLE", "EXPERT_LOAD"]
