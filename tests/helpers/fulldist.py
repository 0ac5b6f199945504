"""Top-k log-probs and router weights for a seeded step (add_fulldist), the same step as sequence JSON Lines, and
brute-force references of the METRICS.md v3 "Full distribution" and weight columns: Python sets and dicts per
position, math.fsum per group, written from the definitions alone (not from analysis/)."""
from __future__ import annotations

import json
import math

import numpy as np
import torch


def add_fulldist(step: dict, J: int = 6, vocab: int = 14, seed: int = 0) -> dict:
    """`step` (helpers.logger.make_step, routing of both sides) with the four top-J tensors (fp32 log-probs, ids
    from a small vocabulary so that overlaps vary) and fp32 weights of both sides: the trainer's follow the
    sampler's weight of the same expert, plus noise. Some positions have identical sides, some disjoint lists,
    some one shared id."""
    g = torch.Generator().manual_seed(seed)
    B, T = step["mask"].shape
    out = dict(step)

    def lists():
        ids = torch.stack([torch.randperm(vocab, generator=g)[:J] for _ in range(B * T)]).view(B, T, J)
        lp = torch.log(torch.rand(B, T, J, generator=g, dtype=torch.float64) * (0.9 / J) + 1e-4)
        return ids, lp.to(torch.float32)
    si, sl = lists()
    ti, tl = lists()
    ti[0, 1], tl[0, 1] = si[0, 1], sl[0, 1]  # identical sides
    ti[1, 0] = si[1, 0].roll(1)  # the same ids, other log-probs and order
    ti[0, 2] = torch.arange(vocab, vocab + J)  # disjoint lists
    ti[1, 1] = torch.arange(vocab, vocab + J)
    ti[1, 1, 3] = si[1, 1, 0]  # one shared id
    out |= dict(sampler_topk_ids=si, sampler_topk_logprobs=sl, trainer_topk_ids=ti, trainer_topk_logprobs=tl)
    se, te = step["sampler_experts"], step["trainer_experts"]
    sw = torch.rand(se.shape, generator=g, dtype=torch.float64).to(torch.float32)
    # the sampler's weight of each trainer expert where it has one, plus noise; a fresh weight elsewhere
    eq = te[..., :, None] == se[..., None, :]
    tw = torch.where(eq.any(-1), torch.where(eq, sw[..., None, :], 0.0).sum(-1), torch.rand(te.shape, generator=g))
    tw = tw + 0.01 * torch.rand(te.shape, generator=g)
    out |= dict(sampler_weights=sw, trainer_weights=tw.to(torch.float32))
    return out


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        return (x.float() if x.dtype in (torch.bfloat16, torch.float16) else x).numpy()  # widened exactly
    return np.asarray(x)


def topk_reference(step: dict, rows=None) -> dict[str, float]:
    """The topk_* and top1_agree columns (means over the trained positions) of one logged step; `rows`: only the
    positions of these rows (sequences)."""
    cols = topk_terms(step, rows)
    return {c: math.fsum(v) / len(v) for c, v in cols.items()}


def topk_terms(step: dict, rows=None) -> dict[str, list[float]]:
    """Each trained position's terms of the topk_* and top1_agree columns (of the rows `rows`, default all)."""
    mask = _np(step["mask"]).astype(bool)
    si, sl, ti, tl = (_np(step[k]) for k in ("sampler_topk_ids", "sampler_topk_logprobs", "trainer_topk_ids",
                                             "trainer_topk_logprobs"))
    cols = {c: [] for c in ("topk_overlap", "top1_agree", "topk_mass_sampler", "topk_mass_trainer",
                            "topk_kl_shared", "topk_tv_lower", "topk_tv_upper")}
    for b, p in zip(*np.nonzero(mask)):
        if rows is not None and b not in rows:
            continue
        s = {int(i): float(v) for i, v in zip(si[b, p], sl[b, p])}
        t = {int(i): float(v) for i, v in zip(ti[b, p], tl[b, p])}
        shared = set(s) & set(t)
        ms = math.fsum(math.exp(s[i]) for i in shared)
        mt = math.fsum(math.exp(t[i]) for i in shared)
        kl = 0.0
        if len(shared) > 1:
            kl = math.fsum((math.exp(s[i]) / ms) * math.log((math.exp(s[i]) / ms) / (math.exp(t[i]) / mt))
                           for i in shared)
        l1 = math.fsum(abs(math.exp(s[i]) - math.exp(t[i])) for i in shared)
        top_s = max(s, key=lambda i: (s[i], -list(s).index(i)))  # the first id with the largest log-prob
        top_t = max(t, key=lambda i: (t[i], -list(t).index(i)))
        cols["topk_overlap"].append(len(shared) / len(s))
        cols["top1_agree"].append(float(top_s == top_t))
        cols["topk_mass_sampler"].append(math.fsum(math.exp(v) for v in s.values()))
        cols["topk_mass_trainer"].append(math.fsum(math.exp(v) for v in t.values()))
        cols["topk_kl_shared"].append(kl)
        cols["topk_tv_lower"].append(0.5 * l1 + 0.5 * abs(ms - mt))
        cols["topk_tv_upper"].append(0.5 * l1 + 0.5 * (1 - ms) + 0.5 * (1 - mt))
    return cols


def weight_reference(step: dict) -> dict[int, tuple[float, float]]:
    """{layer: (weight_abs_diff_mean, weight_abs_diff_max)} over the trained tokens whose expert sets are equal."""
    mask = _np(step["mask"]).astype(bool)
    se, te, sw, tw = (_np(step[k]) for k in ("sampler_experts", "trainer_experts", "sampler_weights",
                                             "trainer_weights"))
    out = {}
    for layer in range(se.shape[2]):
        diffs = []
        for b, p in zip(*np.nonzero(mask)):
            s, t = list(se[b, p, layer]), list(te[b, p, layer])
            if set(s) != set(t):
                continue
            diffs.append(math.fsum(abs(float(sw[b, p, layer, k]) - float(tw[b, p, layer, t.index(e)]))
                                   for k, e in enumerate(s)))
        if diffs:
            out[layer] = (math.fsum(diffs) / len(diffs), max(diffs))
    return out


def sequence_lines(step: dict, step_no: int, run: str = "r") -> list[str]:
    """The step as sequence JSON Lines (SCHEMA.md family 2): one line per sequence with its trained positions (the
    mask of helpers.logger.make_step is a prefix), every per-token array the logger got, top-k, weights and margins too."""
    mask = _np(step["mask"]).astype(bool)
    ids = _np(step["sample_ids"])
    lines = []
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        assert mask[b, :n].all(), "a prefix mask"
        obj = {"run": run, "step": step_no, "sample": int(ids[b])}
        for key, name in (("sampler_logprobs", "sampler_logprobs"), ("trainer_logprobs", "trainer_logprobs"),
                          ("token_ids", "token_ids"), ("sampler_experts", "sampler_experts"),
                          ("trainer_experts", "trainer_experts"), ("sampler_weights", "sampler_weights"),
                          ("trainer_weights", "trainer_weights"), ("sampler_topk_ids", "sampler_topk_ids"),
                          ("sampler_topk_logprobs", "sampler_topk_logprobs"), ("trainer_topk_ids", "trainer_topk_ids"),
                          ("trainer_topk_logprobs", "trainer_topk_logprobs"), ("sampler_margins", "sampler_margins"),
                          ("trainer_margins", "trainer_margins")):
            if key in step:
                v = _np(step[key])[b, :n]
                obj[name] = v.astype(np.float64).tolist() if v.dtype.kind == "f" else v.astype(np.int64).tolist()
        lines.append(json.dumps(obj))
    return lines


def ingest_sequence_lines(folder, steps: dict):
    """{step_no: step} written as one sequence JSON Lines file under `folder` and ingested into a new database
    there; returns its Store (open), after asserting the file loaded."""
    from analysis.ingest import ingest_paths
    from analysis.store import Store

    path = folder / "seqs.jsonl"
    path.write_text("\n".join(line for n, d in steps.items() for line in sequence_lines(d, n)) + "\n")
    store = Store(folder / "db.duckdb")
    outcomes = ingest_paths(store, [path])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    return store
