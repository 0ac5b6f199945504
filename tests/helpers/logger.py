"""Steps as a trainer hands them to DriftLogger: a seeded torch step with padding, staleness and routing of both
sides (make_step), a tiny numpy one (step_arrays); the database that ingesting every token of a step gives,
the reference for what the logger's summaries must equal, and the logger's own (logger_store); summary rows
merged per key as every reader merges them (merged), compared at rel 1e-12 (assert_same_rows)."""
from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import torch

from analysis.ingest import ingest_paths, summary_files
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries import schema as S


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


COMPARED = ("summary_step", "summary_seq", "summary_seq_band", "summary_hist", "summary_bucket", "summary_bucket_band",
            "summary_layer", "expert_load")


def merged(store: Store, table: str) -> list[dict]:
    cols = summary_files.TABLES[table]
    key = [c.name for c in cols if S.merge_kind(c.name) == "key"]
    agg = [f"{S.merge_kind(c.name)}({c.name}) AS {c.name}" for c in cols if S.merge_kind(c.name) != "key"]
    return store.sql(f"SELECT {', '.join(key + agg)} FROM {table} GROUP BY ALL ORDER BY ALL").to_dicts()


# 1 − p_t is formed as (1 − p_s) − (p_t − p_s) (summaries/compute.py): where p_t = 1 (t = 0, common in bf16) it is
# 0 up to one rounding of a term ≤ 1, ~1e-17, and two correct implementations differ there by that much
QT_TERMS = ("sum_qt", "sum_qt2", "sum_qsqt")


def assert_same_rows(got: list[dict], want: list[dict], table: str, rel: float = 1e-12) -> None:
    assert len(got) == len(want), f"{table}: {len(got)} rows, reference {len(want)}"
    for g, w in zip(got, want):
        for k, v in w.items():
            if isinstance(v, float) and g[k] is not None:
                tiny = 4e-16 * float(w["n_tokens"]) if k in QT_TERMS else 1e-300
                assert math.isclose(g[k], v, rel_tol=rel, abs_tol=tiny), (table, k, g, w)
            else:
                assert g[k] == v, (table, k, g, w)


def logger_store(tmp_path, step_data, token_sample, step=4, name="logged") -> Store:
    log = DriftLogger(tmp_path / name, "r", token_sample=token_sample, worst_sequences=2, top_tokens=5)
    paths = log.log_step(step, **step_data)
    assert pq.read_schema(paths["summary"]).metadata[summary_files.SUMMARY_KEY] == summary_files.FORMAT_VERSION
    store = Store(tmp_path / f"{name}.duckdb")
    outcomes = ingest_paths(store, [tmp_path / name])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    return store
