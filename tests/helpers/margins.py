"""Router margins for a seeded step (add_margins) and brute-force references of METRICS.md v3 margin_mean_* and
flip_rate_by_margin, written from the definitions alone (Python sets and math.fsum; not from analysis/)."""
from __future__ import annotations

import math

import numpy as np
import torch

EDGES = (0.0, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)


def add_margins(step: dict, seed: int = 0, sides=("sampler", "trainer")) -> dict:
    """`step` (helpers.logger.make_step) with [B, T, L] fp32 margins of the chosen sides: log-uniform over
    1e-6 .. 1, exact 0, 1 and fp32 values of the edges among them (fp32(1e-4) lies below 1e-4: bin 0)."""
    g = torch.Generator().manual_seed(seed + 77)
    B, T, L, _ = step["sampler_experts"].shape
    out = dict(step)
    for side in sides:
        m = 10.0 ** (-6.0 * torch.rand(B, T, L, generator=g, dtype=torch.float64))
        pick = torch.rand(B, T, L, generator=g)
        m[pick < 0.05] = 0.0
        m[(pick >= 0.05) & (pick < 0.08)] = 1.0
        m[(pick >= 0.08) & (pick < 0.12)] = 1e-4
        m[(pick >= 0.12) & (pick < 0.15)] = 0.1
        out[f"{side}_margins"] = m.to(torch.float32)
    return out


def _bin(m: float) -> int:
    return sum(m >= e for e in EDGES[1:-1])


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def margin_means(step: dict) -> dict[tuple[int, str], float]:
    """{(layer, side): mean margin over the trained tokens} (margins as fp32, widened)."""
    mask = _np(step["mask"]).astype(bool)
    out = {}
    for side in ("sampler", "trainer"):
        if f"{side}_margins" not in step:
            continue
        m = _np(step[f"{side}_margins"]).astype(np.float32)
        for layer in range(m.shape[2]):
            vals = [float(m[b, p, layer]) for b, p in zip(*np.nonzero(mask))]
            out[(layer, side)] = math.fsum(vals) / len(vals)
    return out


def by_margin(steps: list[dict], side: str) -> dict[int, tuple[int, float, float]]:
    """{margin bin: (rows, flip rate, mean |Δ|)} over the trained (token, layer) rows of `steps` by `side`'s margin;
    a flip: the two expert sets differ; |Δ| = |t − s| of the row's token in float64."""
    rows: dict[int, list[tuple[bool, float]]] = {}
    for step in steps:
        mask = _np(step["mask"]).astype(bool)
        s = _np(step["sampler_logprobs"]).astype(np.float64)
        t = _np(step["trainer_logprobs"]).astype(np.float64)
        se, te = _np(step["sampler_experts"]), _np(step["trainer_experts"])
        m = _np(step[f"{side}_margins"]).astype(np.float32)
        for b, p in zip(*np.nonzero(mask)):
            for layer in range(se.shape[2]):
                flip = set(se[b, p, layer].tolist()) != set(te[b, p, layer].tolist())
                rows.setdefault(_bin(float(m[b, p, layer])), []).append((flip, abs(float(t[b, p]) - float(s[b, p]))))
    return {k: (len(v), sum(f for f, _ in v) / len(v), math.fsum(d for _, d in v) / len(v))
            for k, v in sorted(rows.items())}


TAGS = ["code", "math", "chat", "code", "math", "code", "math", "chat"]


def margin_logs(folder, plain: bool = True) -> None:
    """DriftLogger logs of run "full" (margins of both sides, top-k lists, tags; 3 steps of 8 sequences) and,
    with `plain`, run "plain" (routing only), for the page tests."""
    from analysis.record.logger import DriftLogger
    from helpers.fulldist import add_fulldist
    from helpers.logger import make_step

    log = DriftLogger(folder, "full", token_sample=0.1)
    other = DriftLogger(folder, "plain", token_sample=0.1) if plain else None
    for step in (1, 2, 3):
        data = add_margins(add_fulldist(make_step(B=8, T=10, seed=step), seed=step), seed=step)
        log.log_step(step, tags=TAGS, **data)
        if other is not None:
            other.log_step(step, **make_step(B=8, T=10, seed=step))
