"""Seeded runs of random tokens and routing, and their loading through the real ingest path into a fresh Store.
The metrics_* names are the conftest fixtures' topic (analysis metrics), whose data they build."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq


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
    return routing_frame(keys, layers, S, T if trainer else None)


def routing_frame(keys: pl.DataFrame, layers: int, S: np.ndarray, T: np.ndarray | None) -> pl.DataFrame:
    """Routing rows of every token of `keys` (run, step, sample, pos) at each of `layers` layers, in that order:
    the sampler's experts S[i] and, unless T is None, the trainer's T[i] for row i ([rows, k] arrays)."""
    rep = keys[np.repeat(np.arange(keys.height), layers)]
    df = rep.with_columns(layer=pl.Series(np.tile(np.arange(layers, dtype=np.int32), keys.height)),
                          sampler_experts=pl.Series(S.tolist(), dtype=pl.List(pl.Int32)))
    if T is not None:
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


def metrics_db(tmp_path: Path, tokens: pl.DataFrame, configs: dict[str, dict]) -> Path:
    """`metrics_load` of `tokens`, each run of `configs` given its config, closed: the database's path (what
    the AppTest page tests open)."""
    store = metrics_load(tmp_path, tokens)
    for run, config in configs.items():
        store.set_run_config(run, config)
    path = store.path
    store.close()
    return path


def write_parquet(path, df: pl.DataFrame, metadata: dict | None = None) -> None:
    """`df` as a Parquet file, with `metadata` as the file's schema metadata (the logger's marks) when given."""
    table = df.to_arrow()
    if metadata:
        table = table.replace_schema_metadata(metadata)
    pq.write_table(table, path)


def load_files(tmp_path, name: str, parts: list[tuple[str, pl.DataFrame]]):
    """A fresh Store (tmp_path/name.duckdb) loaded from `parts` [(file name, frame)], one Parquet file each."""
    from analysis.ingest import ingest_paths
    from analysis.store import Store

    folder = tmp_path / name
    folder.mkdir()
    paths = []
    for fname, df in parts:
        write_parquet(folder / fname, df)
        paths.append(folder / fname)
    store = Store(tmp_path / f"{name}.duckdb")
    bad = [o.line() for o in ingest_paths(store, paths) if o.status != "loaded"]
    assert not bad, bad
    return store
