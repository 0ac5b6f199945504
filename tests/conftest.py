"""Shared pytest fixtures. Each helper group is named after its owner's topic (metrics_*: analysis metrics)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pytest


# -- metrics_*: seeded drift data loaded through the real ingest path ------------------------------------

@dataclass
class MetricsData:
    """Per-token and per-(token, layer) numpy-friendly frames of what was written to the files."""
    tokens: pl.DataFrame   # run, step, sample, pos, token_id, token, s/t log-probs, versions, entropy
    routing: pl.DataFrame | None  # run, step, sample, pos, layer, sampler_experts, trainer_experts


def metrics_make_tokens(seed: int, runs=("a", "b"), steps=(0, 1, 2), n_seq=5, max_len=40, sd=0.3,
                        optional=True) -> pl.DataFrame:
    """Random tokens: variable-length sequences, log-probs ≤ 0, Δ ~ N(0, sd) with a few heavy tails."""
    rng = np.random.default_rng(seed)
    rows = []
    for run in runs:
        for step in steps:
            for sample in range(n_seq):
                n = int(rng.integers(1, max_len + 1))
                s = -rng.exponential(1.5, n)
                d = rng.normal(0.0, sd, n)
                d[rng.random(n) < 0.03] *= 20.0  # rare large mismatches: exercise r > C and r < 1/C
                t = np.minimum(s + d, 0.0)
                sv = np.full(n, step - int(rng.integers(0, 3)))
                rows.append(pl.DataFrame({
                    "run": [run] * n, "step": [step] * n, "sample": [sample] * n, "pos": np.arange(n),
                    "token_id": rng.integers(0, 12, n), "sampler_logprob": s, "trainer_logprob": t,
                    "sampler_version": sv, "trainer_version": np.full(n, step),
                    "sampler_entropy": rng.gamma(2.0, 0.5, n),
                }))
    df = pl.concat(rows).with_columns(token=pl.format("tok{}", pl.col("token_id")))
    if not optional:
        df = df.drop("token_id", "token", "sampler_version", "trainer_version", "sampler_entropy")
    return df


def metrics_make_routing(tokens: pl.DataFrame, seed: int, layers=6, k=3, n_experts=10, flip_p=0.25,
                         trainer=True) -> pl.DataFrame:
    """Top-k routing for every token and layer; the trainer side permutes the sampler's set (same set,
    shuffled order) or swaps one expert with probability `flip_p`."""
    rng = np.random.default_rng(seed)
    keys = tokens.select("run", "step", "sample", "pos")
    n = keys.height * layers
    S = np.argsort(rng.random((n, n_experts)), axis=1)[:, :k].astype(np.int32)
    T = S.copy()
    for i in range(n):
        T[i] = rng.permutation(T[i]) if rng.random() < 0.5 else T[i]
        if rng.random() < flip_p:
            unused = np.setdiff1d(np.arange(n_experts), S[i])
            T[i, rng.integers(0, k)] = rng.choice(unused)
    rep = keys[np.repeat(np.arange(keys.height), layers)]
    df = rep.with_columns(layer=pl.Series(np.tile(np.arange(layers, dtype=np.int32), keys.height)),
                          sampler_experts=pl.Series(S.tolist(), dtype=pl.List(pl.Int32)))
    if trainer:
        df = df.with_columns(trainer_experts=pl.Series(T.tolist(), dtype=pl.List(pl.Int32)))
    return df


def metrics_load(tmp_path: Path, tokens: pl.DataFrame, routing: pl.DataFrame | None = None,
                 fmt: str = "parquet"):
    """Write the frames to files and load them with `ingest_paths` into a fresh Store; returns the Store."""
    from analysis.ingest import ingest_paths
    from analysis.store import Store

    tmp_path.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, df in (("tokens", tokens), ("routing", routing)):
        if df is None:
            continue
        p = tmp_path / f"{name}.{fmt}"
        if fmt == "parquet":
            df.write_parquet(p)
        else:
            df.write_ndjson(p)
        paths.append(p)
    store = Store(tmp_path / "t.duckdb")
    outcomes = ingest_paths(store, paths)
    bad = [o.line() for o in outcomes if o.status != "loaded"]
    assert not bad, bad
    return store


@pytest.fixture(scope="session")
def metrics_data(tmp_path_factory) -> tuple[object, MetricsData]:
    """(Store, MetricsData): two runs, three steps, routing with both sides (session-wide, read only)."""
    tokens = metrics_make_tokens(seed=7)
    routing = metrics_make_routing(tokens, seed=8)
    store = metrics_load(tmp_path_factory.mktemp("metrics"), tokens, routing)
    yield store, MetricsData(tokens, routing)
    store.close()


@pytest.fixture
def metrics_store_from(tmp_path):
    """Factory: metrics_store_from(tokens, routing=None, fmt="parquet") -> Store on a fresh database."""
    stores = []

    def make(tokens, routing=None, fmt="parquet", sub="db"):
        store = metrics_load(tmp_path / sub, tokens, routing, fmt)
        stores.append(store)
        return store
    yield make
    for s in stores:
        try:
            s.close()
        except Exception:
            pass


@pytest.fixture
def store(tmp_path_factory):
    """An empty Store whose database lives outside `tmp_path`: tests ingest that folder (and its parents)."""
    from analysis.store import Store
    s = Store(tmp_path_factory.mktemp("db") / "db.duckdb")
    yield s
    s.close()


@pytest.fixture(scope="session")
def app_template_db(tmp_path_factory):
    """The page tests' fixture database (tests/browser_util.py), built once per session; tests copy it."""
    import browser_util as bu
    root = tmp_path_factory.mktemp("app-template")
    db = root / "template.duckdb"
    bu.build_fixture_db(db, root / "logs")
    return db
