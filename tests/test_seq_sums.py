"""summary_seq's per-sequence log-prob sums (schema.SEQ_SUMS: Σ s, Σ t, Σ log cosh(Δ/2), Σ r·t) against numpy at
rel 1e-12, from every writer (ingest's SQL, the streamed kernel path, DriftLogger) and from the token rows; and the
framework views on a database whose rows predate them (nulls, or no such columns read-only) equal those with them.
"""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch

from analysis.metrics.frameworks import framework_table, inputs
from analysis.store import Store
from analysis.summaries import schema as S
from analysis.summaries.sql import token_filter

from helpers.data import metrics_load
from helpers.ingest import summaries_by_sql

RTOL = 1e-12


def make_tokens(seed: int = 7) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    rows = []
    for step in (0, 1):
        for sample in range(5):
            n = int(rng.integers(1, 30))
            d = rng.normal(0.0, 0.4, n) * np.where(rng.random(n) < 0.2, 1e-4, 1.0)  # tiny |Δ| too
            if sample == 3:
                d[0] = 23.0 if step == 0 else -25.0  # |Δ| > 20: r is clamped, log cosh is not
            s = -rng.exponential(1.5, n) - np.maximum(d, 0.0) - 0.01
            rows.append(pl.DataFrame({"run": "a", "step": step, "sample": sample, "pos": np.arange(n),
                                      "sampler_logprob": s, "trainer_logprob": s + d}))
    return pl.concat(rows)


def log_cosh_half(d: np.ndarray) -> np.ndarray:
    """log cosh(d/2), an independent form: log(e^{d/2} + e^{−d/2}) − ln 2 by logaddexp, and for |d| < 2 the
    cancellation-free log1p(cosh(d/2) − 1) with cosh x − 1 = 2 sinh²(x/2)."""
    x = 0.5 * d
    return np.where(np.abs(x) < 1.0, np.log1p(2.0 * np.sinh(0.5 * x) ** 2), np.logaddexp(x, -x) - math.log(2.0))


def reference(tokens: pl.DataFrame) -> dict[tuple, dict[str, float]]:
    out = {}
    for (run, step, sample), g in tokens.group_by(["run", "step", "sample"]):
        s, t = g["sampler_logprob"].to_numpy(), g["trainer_logprob"].to_numpy()
        r = np.exp(np.clip(t - s, -20.0, 20.0))
        out[(run, step, sample)] = {"n_lp_tokens": len(s), "sum_s": math.fsum(s), "sum_t": math.fsum(t),
                                    "sum_js": math.fsum(log_cosh_half(t - s)), "sum_rt": math.fsum(r * t)}
    return out


def assert_sums(rows: list[dict], ref: dict) -> None:
    assert len(rows) == len(ref)
    for row in rows:
        want = ref[(row["run"], row["step"], row["sample"])]
        for k, v in want.items():
            assert math.isclose(row[k], v, rel_tol=RTOL, abs_tol=1e-300), (k, row, want)


def stored_sums(store: Store) -> list[dict]:
    cols = ", ".join(S.merge_sql("summary_seq", c) + f" AS {c}" for c in S.SEQ_SUM_NAMES)
    return store.sql(f"SELECT run, step, sample, {cols} FROM summary_seq GROUP BY ALL ORDER BY ALL").to_dicts()


@pytest.mark.parametrize("streamed", [True, False])
def test_ingest_writes_the_sums(tmp_path, monkeypatch, streamed):
    summaries_by_sql(monkeypatch, not streamed)
    tokens = make_tokens()
    store = metrics_load(tmp_path, tokens)
    assert_sums(stored_sums(store), reference(tokens))
    store.close()


def test_token_rows_give_the_same_sums(tmp_path):
    tokens = make_tokens(8)
    store = metrics_load(tmp_path, tokens)
    where, params = token_filter(store, ["a"])
    rows = store.sql(inputs.logprob_sql(where), params).to_dicts()
    ref = reference(tokens)
    assert_sums([r | {"n_lp_tokens": ref[(r["run"], r["step"], r["sample"])]["n_lp_tokens"]} for r in rows], ref)
    store.close()


@pytest.mark.parametrize("engine", ["kernel", "torch"])
def test_driftlogger_sums(engine):
    from analysis.record.summaries import StepTensors, _kernel_tables, seq_logprob_sums
    tokens = make_tokens(9).filter(pl.col("step") == 0)
    B, T = 5, int(tokens["pos"].max()) + 1
    s, t, m = np.full((B, T), np.nan), np.full((B, T), np.nan), np.zeros((B, T), bool)  # padding: NaN
    for r in tokens.iter_rows(named=True):
        s[r["sample"], r["pos"]], t[r["sample"], r["pos"]] = r["sampler_logprob"], r["trainer_logprob"]
        m[r["sample"], r["pos"]] = True
    x = StepTensors(torch.from_numpy(s), torch.from_numpy(t), torch.from_numpy(m), torch.arange(B) + 10, None,
                    None, None, None, None)
    per_row = None
    if engine == "kernel":  # the sums the kernel's pass takes (DriftLogger on the CPU)
        per_row = np.zeros((5, B))
        _kernel_tables(x, None, None, per_row)
    got = seq_logprob_sums(x, np.array([13, 10, 12, 11, 14]), per_row)
    rows = [{"run": "a", "step": 0, "sample": int(i) - 10} | {k: v[j] for k, v in got.items()}
            for j, i in enumerate([13, 10, 12, 11, 14])]
    assert_sums(rows, reference(tokens))


@pytest.mark.parametrize("name", ["verl", "verl-actor", "nemo"])
def test_views_fall_back_to_the_token_rows(tmp_path, name):
    """Rows that predate the sums (null) and a read-only database without the columns give the same views."""
    tokens = make_tokens(10)
    store = metrics_load(tmp_path, tokens)
    want = framework_table(store, ["a"], name)
    with store.transaction() as w:
        w.execute("UPDATE summary_seq SET n_lp_tokens = NULL, sum_s = NULL, sum_t = NULL, sum_js = NULL, "
                  "sum_rt = NULL WHERE step = 1 OR sample = 2")
    half = framework_table(store, ["a"], name)
    with store.transaction() as w:
        for c in S.SEQ_SUM_NAMES:
            w.execute(f"ALTER TABLE summary_seq DROP COLUMN {c}")
    store.close()
    with Store(tmp_path / "t.duckdb", read_only=True) as old:
        assert not old.has_seq_sums
        none = framework_table(old, ["a"], name)
    for got in (half, none):
        assert got.columns == want.columns and got.height == want.height
        for c in want.columns:
            if want[c].dtype == pl.Float64:
                np.testing.assert_allclose(got[c].to_numpy(), want[c].to_numpy(), rtol=1e-12, atol=1e-300)
            else:
                assert got[c].to_list() == want[c].to_list()
