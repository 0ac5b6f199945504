"""Steps as a trainer hands them to DriftLogger: a seeded torch step with padding, staleness and routing of both
sides (make_step), a tiny numpy one (step_arrays); and the database that ingesting every token of a step gives,
the reference for what the logger's summaries must equal."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import torch

from analysis.ingest import ingest_paths
from analysis.record.logger import DriftLogger
from analysis.store import Store


def make_step(B=12, T=30, L=3, K=2, E=6, seed=0, dtype=torch.float32, routing="both"):
    """Seeded step with padding, Δ on both sides of every band (with exact zeros and |Δ| > 20), per-sample
    sampler versions (staleness 0..2) and routing of both sides with set flips and rank-only swaps."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    s = -torch.rand(B, T, generator=g, dtype=torch.float64) * 6
    d = 0.02 + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    d[torch.rand(B, T, generator=g) < 0.1] = 0.0  # identical log-probs: Δ exactly on the edge 0
    t = (s + d).clamp(max=0.0)
    s[0, 0], t[0, 0] = -30.0, -1.0  # |Δ| > 20: the clamp
    s[~mask.bool()] = float("nan")  # padding is never read
    out = dict(sampler_logprobs=s.to(dtype), trainer_logprobs=t.to(dtype), mask=mask,
               token_ids=torch.randint(0, 1000, (B, T), generator=g),
               sampler_version=torch.randint(5, 8, (B,), generator=g), trainer_version=7,
               sample_ids=torch.arange(B) * 3 + 100)
    if routing:
        se = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).view(B, T, L, K)
        te = se.flip(-1).clone()  # same sets, other rank order: top-1 flips only
        moved = torch.rand(B, T, L, generator=g) < 0.2
        fresh = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(B * T * L)]).view(B, T, L, K)
        te[moved] = fresh[moved]
        out["sampler_experts"] = se
        if routing == "both":
            out["trainer_experts"] = te
    return out


def step_arrays(step: int, B: int = 2, T: int = 3):
    rng = np.random.default_rng(step)
    s = -rng.exponential(1.0, (B, T))
    return s, np.minimum(s + rng.normal(0, 0.05, (B, T)), 0.0), np.ones((B, T), dtype=np.int64)


def reference_store(tmp_path, step_data, step=4) -> Store:
    """Ingest of every token: the logger's token rows with the summarised mark removed."""
    DriftLogger(tmp_path / "full", "r").log_step(step, **step_data)
    plain = tmp_path / "plain"
    plain.mkdir()
    for kind in ("tokens", "routing"):
        f = tmp_path / "full" / "r" / f"{kind}-step{step:06d}.parquet"
        if f.exists():
            table = pq.read_table(f)
            pq.write_table(table.replace_schema_metadata({}), plain / f.name)
    store = Store(tmp_path / "ref.duckdb")
    outcomes = ingest_paths(store, [plain], run=None)
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    assert store.scalar("SELECT count(*) FROM summary_skip") == 0
    return store
