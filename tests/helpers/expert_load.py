"""Seeded expert-load counts written straight into a Store's expert_load table, and plain-Python references of the
load columns (METRICS.md, "Expert load") to hold analysis/metrics/load.py against."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from analysis.store import Store


def skewed_counts(seed: int, steps: int, layers: int, experts: int, hot: int = 3, tokens: int = 4000,
                  zero: tuple[int, ...] = ()) -> np.ndarray:
    """Counts [step, layer, expert]: log-normal weights per (layer, expert) with a persistent hot set (the same
    `hot` experts ×6 at every step), a little noise per step, `zero` experts never routed."""
    rng = np.random.default_rng(seed)
    base = rng.lognormal(0.0, 0.8, size=(layers, experts))
    hot_ids = rng.choice(experts, size=hot, replace=False)
    base[:, hot_ids] *= 6.0
    base[:, list(zero)] = 0.0
    out = np.zeros((steps, layers, experts), np.int64)
    for s in range(steps):
        w = base * rng.lognormal(0.0, 0.15, size=base.shape)
        w[:, list(zero)] = 0.0
        for li in range(layers):
            out[s, li] = rng.multinomial(tokens, w[li] / w[li].sum())
    return out


def write_counts(db: Path, run: str, sampler: np.ndarray, trainer: np.ndarray | None = None,
                 config: dict | None = None, steps0: int = 0, file_id: int = 1, split: bool = False) -> Store:
    """A Store whose expert_load holds the counts (rows with 0 on both sides left out, as ingest does);
    `split`: each count in two rows of different files (queries must sum them)."""
    store = Store(db)
    S, L, E = sampler.shape
    rows = []
    for s in range(S):
        for li in range(L):
            for e in range(E):
                ns = int(sampler[s, li, e])
                nt = int(trainer[s, li, e]) if trainer is not None else 0
                if ns or nt:
                    if split:
                        rows.append((run, steps0 + s, li, e, ns // 2, nt // 2, file_id))
                        rows.append((run, steps0 + s, li, e, ns - ns // 2, nt - nt // 2, file_id + 1))
                    else:
                        rows.append((run, steps0 + s, li, e, ns, nt, file_id))
    with store.transaction() as w:
        w.execute("INSERT INTO runs (run, config) VALUES (?, ?) ON CONFLICT DO NOTHING",
                  [run, json.dumps(config or {})])
        w.cur.executemany("INSERT INTO expert_load VALUES (?, ?, ?, ?, ?, ?, ?)", rows)
    return store


def ref_expert(c: list[float], top_k: int | None = None) -> dict[str, float | None]:
    """The expert-level columns of one (step, layer, side) by their written definitions, in plain Python;
    with top_k, prime-rl's max_vio (the top_k most loaded experts dropped first)."""
    n = len(c)
    total = math.fsum(c)
    names = ("load_max_vio", "load_max_vio_all", "load_cv", "load_entropy_norm", "load_hot_experts") \
        + (("load_max_vio_primerl",) if top_k else ())
    if total == 0:
        return {k: None for k in names}
    out = {}
    if top_k:
        rest = sorted(c, reverse=True)[top_k:]
        m = math.fsum(rest) / len(rest)
        out["load_max_vio_primerl"] = (max(rest) - m) / m if m else None
    seen = [x for x in c if x > 0]
    mean_seen = math.fsum(seen) / len(seen)
    mean = total / n
    var = math.fsum((x - mean) ** 2 for x in c) / n
    h = -math.fsum((x / total) * math.log(x / total) for x in c if x > 0)
    return out | {"load_max_vio": (max(c) - mean_seen) / mean_seen, "load_max_vio_all": (max(c) - mean) / mean,
                  "load_cv": math.sqrt(var) / mean, "load_entropy_norm": h / math.log(n) if n > 1 else None,
                  "load_hot_experts": sum(1 for x in c if x > 2 * mean)}


def ref_ranks(c: list[float], slots: list[int], n_ranks: int) -> list[float]:
    """Tokens per rank: slot s on rank s // (slots per rank); an expert's tokens split evenly over its slots."""
    per = len(slots) // n_ranks
    replicas = {e: slots.count(e) for e in set(slots)}
    out = [0.0] * n_ranks
    for s, e in enumerate(slots):
        out[s // per] += c[e] / replicas[e]
    return out


def ref_rank(r: list[float]) -> dict[str, float | None]:
    total = math.fsum(r)
    if total == 0:
        return {"rank_balancedness": None, "rank_imbalance": None, "straggler": None}
    mean = total / len(r)
    return {"rank_balancedness": mean / max(r), "rank_imbalance": max(r) / mean - 1, "straggler": max(r) / mean}


def close(got, want, rel: float = 1e-12) -> bool:
    if want is None:
        return got is None
    return got is not None and math.isclose(got, want, rel_tol=rel, abs_tol=1e-300)
