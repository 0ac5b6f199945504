"""Quantiles of token |Δ| and per-sequence Δ from the summaries (analysis/metrics/quantiles.py) against numpy over every
token: exact where the token rows are complete (values on bin edges and ties included), within one histogram bin
where DriftLogger kept a sample."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest

from analysis.ingest import ingest_paths
from analysis.metrics import quantiles as Q
from analysis.metrics import read
from analysis.metrics.corrections import log_ratio_quantiles
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries import schema as S

PROBS = (0.5, 0.99)


def _tokens(run: str, seed: int, steps: int = 4) -> pl.DataFrame:
    """Δ spread over decades, plus ties: a share of tokens exactly 0, exactly on bin edges (ln 2, −ln 1.2) and
    repeated values, so ranks fall inside point cells and between cells."""
    rng = np.random.default_rng(seed)
    parts = []
    for step in range(steps):
        for sample in range(int(rng.integers(5, 9))):
            n = int(rng.integers(20, 60))
            s = -rng.exponential(2.0, n) - 5.0
            d = rng.normal(0, 1, n) * 10.0 ** rng.uniform(-6, 0, n)
            pick = rng.random(n)
            d = np.where(pick < 0.15, 0.0, d)
            d = np.where((pick >= 0.15) & (pick < 0.25), math.log(2.0), d)
            d = np.where((pick >= 0.25) & (pick < 0.3), -math.log(1.2), d)
            d = np.where((pick >= 0.3) & (pick < 0.35), 0.0123, d)
            parts.append(pl.DataFrame({"run": run, "step": step, "sample": sample, "pos": np.arange(n),
                                       "sampler_logprob": s, "trainer_logprob": s + d}))
    return pl.concat(parts)


@pytest.fixture()
def store(tmp_path):
    paths = []
    for i, run in enumerate(("a", "b")):
        p = tmp_path / f"{run}.parquet"
        _tokens(run, 10 + i).write_parquet(p)
        paths.append(p)
    st = Store(tmp_path / "q.duckdb")
    assert [o.status for o in ingest_paths(st, paths)] == ["loaded", "loaded"]
    yield st
    st.close()


def _numpy(store: Store, keys: list[str], steps=None) -> dict[tuple, dict[str, float]]:
    df = store.sql("SELECT run, step, sample, trainer_logprob - sampler_logprob AS d FROM tokens")
    if steps:
        df = df.filter(pl.col("step").is_between(*steps))
    out = {}
    for group, part in df.group_by(keys):
        d = part["d"].to_numpy()
        per = part.group_by("sample", "step").agg(pl.col("d").mean().alias("m"), pl.col("d").sum().alias("s"))
        row = {}
        for name, x in (("token", np.abs(d)), ("seq_mean", np.abs(per["m"].to_numpy())),
                        ("seq_sum", np.abs(per["s"].to_numpy()))):
            for p in PROBS:
                row[f"{name}_p{round(p * 100)}"] = float(np.quantile(x, p))
        out[tuple(group)] = row
    return out


@pytest.mark.parametrize("by,steps", [("run", None), ("step", None), ("run", (1, 2))])
def test_quantiles_equal_numpy_over_every_token(store, by, steps):
    keys = ["run", "step"] if by == "step" else ["run"]
    cov = read.coverage(store)
    assert cov.rows() == store.rows("SELECT run, count(*), count(*), true FROM tokens GROUP BY run ORDER BY run")
    got = log_ratio_quantiles(store, ["a", "b"], by=by, steps=steps)
    want = _numpy(store, keys, steps)
    assert got.height == len(want) and got.columns[:len(keys)] == keys
    for row in got.iter_rows(named=True):
        ref = want[tuple(row[k] for k in keys)]
        assert row["token_exact"] is True
        for col, value in ref.items():
            assert row[col] == pytest.approx(value, rel=1e-12, abs=0), (row, col)


def test_above_the_exact_budget_token_quantiles_come_from_the_histogram(store, monkeypatch):
    exact = log_ratio_quantiles(store, ["a", "b"], by="run")
    monkeypatch.setattr(Q, "EXACT_TOKENS", 10)
    approx = log_ratio_quantiles(store, ["a", "b"], by="run")
    assert not approx["token_exact"].any()
    assert approx.drop("token_p50", "token_p99", "token_exact").equals(exact.drop("token_p50", "token_p99", "token_exact"))
    step = 10 ** 0.1
    for e, a in zip(exact.iter_rows(named=True), approx.iter_rows(named=True)):
        for col in ("token_p50", "token_p99"):
            assert e[col] / step <= a[col] <= e[col] * step or e[col] == a[col] == 0.0


def test_ranks_on_edges_and_ties_are_exact(store):
    # a quarter of the tokens sit on 0, ln 2 or −ln 1.2: check the chosen values are those exact numbers where
    # numpy lands on them (no interpolation across a point cell)
    got = log_ratio_quantiles(store, ["a"], by="step")
    want = _numpy(store, ["run", "step"])
    hits = [row["token_p50"] for row in got.iter_rows(named=True)
            if want[("a", row["step"])]["token_p50"] in (0.0, math.log(2.0), math.log(1.2))]
    assert all(v in (0.0, math.log(2.0), math.log(1.2)) for v in hits)


def test_cells_cover_the_line_once():
    cells = Q.abs_cells()
    assert len(cells) == S.N_BINS
    distinct = sorted(set(cells))
    for (lo1, hi1), (lo2, hi2) in zip(distinct, distinct[1:]):
        assert hi1 <= lo2 or (lo1 == hi1 == lo2) or (lo2 == hi2 == hi1)  # ordered, touching only at edges
    assert distinct[0] == (0.0, 0.0) and math.isinf(distinct[-1][1])


def test_a_sampled_run_is_interpolated_within_its_bin(tmp_path):
    rng = np.random.default_rng(5)
    log = DriftLogger(tmp_path / "logs", run="smp", token_sample=0.02)
    all_d = []
    for step in range(3):
        s = -rng.exponential(1.0, (16, 64)) - 1.0
        d = rng.normal(0, 1, (16, 64)) * 10.0 ** rng.uniform(-4, -1, (16, 64))
        log.log_step(step, s, s + d, np.ones((16, 64), dtype=np.int64))
        all_d.append(np.abs(d).ravel())
    store = Store(tmp_path / "s.duckdb")
    try:
        assert all(o.status == "loaded" for o in ingest_paths(store, [tmp_path / "logs"]))
        assert store.scalar("SELECT count(*) FROM tokens") < 3 * 16 * 64  # a sample
        cov = read.coverage(store).row(0, named=True)  # from the summaries: equals a count of the rows
        assert (cov["n_tokens"], cov["n_token_rows"], cov["complete"]) == (
            3 * 16 * 64, store.scalar("SELECT count(*) FROM tokens"), False)
        row = log_ratio_quantiles(store, ["smp"], by="run").row(0, named=True)
        assert row["token_exact"] is False
        x = np.concatenate(all_d)
        step = 10 ** 0.1  # one display bin: 10 per decade of |Δ|
        for p in PROBS:
            true = float(np.quantile(x, p))
            assert true / step <= row[f"token_p{round(p * 100)}"] <= true * step
    finally:
        store.close()


def test_identical_logprobs_give_zero_quantiles(tmp_path):
    # every wanted rank sits in the point cell |Δ| = 0 (a query with point cells only)
    n = 40
    s = -np.linspace(0.1, 3.0, n)
    df = pl.DataFrame({"run": "same", "step": 0, "sample": np.arange(n) // 10, "pos": np.arange(n) % 10,
                       "sampler_logprob": s, "trainer_logprob": s})
    df.write_parquet(tmp_path / "same.parquet")
    store = Store(tmp_path / "z.duckdb")
    try:
        assert [o.status for o in ingest_paths(store, [tmp_path / "same.parquet"])] == ["loaded"]
        row = log_ratio_quantiles(store, ["same"], by="run").row(0, named=True)
        assert all(row[c] == 0.0 for c in row if c not in ("run", "token_exact"))
    finally:
        store.close()
