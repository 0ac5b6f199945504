"""The one-pass summary kernel (analysis/summaries/kernel.py) gives the rows of the torch writer and of ingest's
SQL (analysis/ingest/summarise.py) at rel 1e-12, and compensated sums over a million tokens.

Three references: the torch writer on the same checked step (`summarise(..., engine="torch")`); ingest of every
token of the step (tests/test_logger_summaries.reference_store); for long-format input (the kernel's Arrow-batch
form: shuffled tokens, holes in positions, entropy, per-token staleness with nulls) a token file ingested by SQL;
and for the sums themselves, math.fsum over numpy terms.
"""
from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from analysis.ingest import ingest_paths, summary_files
from analysis.record.logger import DriftLogger
from analysis.record.summaries import summarise
from analysis.record.token_sample import Kept, SamplePlan
from analysis.store import Store
from analysis.summaries import kernel as K
from analysis.summaries import schema as S

from helpers.logger import COMPARED, assert_same_rows, logger_store, make_step, merged, reference_store

TOKEN_TABLES = ("summary_seq", "summary_seq_band", "summary_step", "summary_hist", "summary_bucket",
                "summary_bucket_band")


def edge_step(B=9, T=40, seed=7, per_token_lag=False):
    """A step with every case the kernel branches on: a mask with holes and an empty row, a sequence of one
    token, Δ exactly on fine and band edges (s = −E, t = 0 or s = 0, t = E, so t − s = E exactly), |Δ| below
    SERIES_BELOW, |Δ| above CLAMP, t = 0, NaN at padding, staleness per sequence or per token."""
    g = torch.Generator().manual_seed(seed)
    s = -torch.rand(B, T, generator=g, dtype=torch.float64) * 8
    d = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.4
    d[:, ::3] *= 1e-3  # |Δ| < SERIES_BELOW: the k3 series
    t = (s + d).clamp(max=0.0)
    edges = torch.tensor(S.D_EDGES, dtype=torch.float64)
    on = edges[torch.randperm(len(edges), generator=g)[:2 * T]].view(2, T)
    s[1], t[1] = torch.where(on[0] > 0, -on[0], 0.0), torch.where(on[0] > 0, 0.0, on[0])  # Δ = E exactly
    s[2], t[2] = torch.where(on[1] > 0, -on[1], 0.0), torch.where(on[1] > 0, 0.0, on[1])
    s[3, :4] = torch.tensor([-30.0, -1.0, -45.0, -0.5])  # |Δ| > CLAMP both ways
    t[3, :4] = torch.tensor([-1.0, -30.0, -0.25, -40.0])
    mask = torch.rand(B, T, generator=g) < 0.7  # holes anywhere
    mask[1:3] = True
    mask[3, :4] = True
    mask[4] = False  # an empty row
    mask[5] = False
    mask[5, 17] = True  # a sequence of one token
    s[~mask], t[~mask] = float("nan"), float("nan")
    assert bool(((t - s)[1:3] == edges[torch.searchsorted(edges, (t - s)[1:3])]).all())
    out = dict(sampler_logprobs=s, trainer_logprobs=t, mask=mask, sample_ids=torch.arange(B) * 7 + 3,
               trainer_version=9)
    if per_token_lag:
        out["sampler_version"] = torch.randint(6, 11, (B, T), generator=g)  # lags −1 .. 3
    else:
        out["sampler_version"] = torch.randint(7, 10, (B,), generator=g)
    return out


def checked(data: dict):
    logger = DriftLogger.__new__(DriftLogger)  # only its input checks
    full = {"token_ids": None, "sampler_experts": None, "trainer_experts": None, "sampler_version": None,
            "trainer_version": None, "sample_ids": None} | data
    return logger._checked(0, **full)


def table_rows(cols: dict) -> list[dict]:
    if not cols:
        return []
    n = len(next(iter(cols.values())))
    return [{k: (v[i].item() if hasattr(v[i], "item") else v[i]) for k, v in cols.items()} for i in range(n)]


def assert_same_tables(got: dict, want: dict) -> None:
    for table in TOKEN_TABLES:
        assert list(got[table]) == list(want[table]), table  # the same columns, in the same order
        assert_same_rows(table_rows(got[table]), table_rows(want[table]), table)


def both_engines(data: dict):
    x = checked(data)
    kept, plan = Kept(int(x.mask.sum()), 0, 0, 0, 0), SamplePlan(0.0, 0, 0, 0)
    return summarise(x, kept, plan, engine="kernel"), summarise(x, kept, plan, engine="torch")


@pytest.mark.parametrize("per_token_lag", [False, True])
def test_kernel_rows_equal_torch_rows(per_token_lag):
    got, want = both_engines(edge_step(per_token_lag=per_token_lag))
    assert_same_tables(got, want)
    lags = {r["bucket"] for r in table_rows(got["summary_bucket"]) if r["dim"] == "lag"}
    assert lags == ({-1, 0, 1, 2, 3} if per_token_lag else {0, 1, 2})
    assert 5 * 7 + 3 in {r["sample"] for r in table_rows(got["summary_seq"])}  # the one-token sequence
    assert 4 * 7 + 3 not in {r["sample"] for r in table_rows(got["summary_seq"])}  # the empty row


def test_kernel_rows_with_routing_equal_torch_rows():
    got, want = both_engines(make_step(B=10, T=25, seed=2))
    assert "n_flip_tokens" in got["summary_seq"] and got["summary_step"]["n_routed"][0] > 0
    assert_same_tables(got, want)


def test_empty_step_gives_the_torch_writers_tables():
    data = edge_step()
    data["mask"] = torch.zeros_like(data["mask"])
    got, want = both_engines(data)
    for table in TOKEN_TABLES:
        assert list(got[table]) == list(want[table]) and not table_rows(got[table]), table


@pytest.mark.parametrize("routed", [False, True])
def test_threads_merge_to_one_pass(monkeypatch, routed):
    """Rows split among threads in pieces of two rows, each thread taking the next piece left (sharing the
    sequence arrays, each with its own bucket sums), merge to the rows of one pass, with and without the routing
    columns."""
    from analysis.record import summaries as logger_summaries
    data = make_step(B=11, T=30, seed=8, **({} if routed else {"routing": None}))
    x = checked(data)
    kept, plan = Kept(int(x.mask.sum()), 0, 0, 0, 0), SamplePlan(0.0, 0, 0, 0)
    one = summarise(x, kept, plan, engine="kernel")
    monkeypatch.setattr(logger_summaries, "KERNEL_SPLIT", 30)
    monkeypatch.setattr(logger_summaries, "KERNEL_PIECE", 60)  # two rows of 30
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        three = summarise(x, kept, plan, engine="kernel")
    finally:
        torch.set_num_threads(threads)
    assert_same_tables(three, one)


@pytest.mark.parametrize("per_token_lag", [False, True])
def test_kernel_rows_equal_ingest_of_every_token(tmp_path, per_token_lag):
    """DriftLogger on the CPU (the kernel) against ingest's SQL over every token of the same step."""
    data = edge_step(per_token_lag=per_token_lag)
    ref = reference_store(tmp_path, data)
    got = logger_store(tmp_path, data, 0.0)
    for table in COMPARED:
        if table in ("summary_layer", "expert_load"):
            continue
        want = merged(ref, table)
        assert want, table
        assert_same_rows(merged(got, table), want, table)


def long_tokens(n_seq=40, seed=3):
    """Long-format tokens as ingest reads them: shuffled, positions with holes, entropy (some null), per-token
    versions (some null), Δ on edges, below SERIES_BELOW and clamped, one sequence of one token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 60, n_seq)
    lengths[0] = 1
    sample = np.repeat(rng.choice(10_000, n_seq, replace=False), lengths)
    pos = np.concatenate([np.sort(rng.choice(200, k, replace=False)) for k in lengths])
    n = len(sample)
    s = -rng.exponential(2.0, n)
    d = rng.normal(0.0, 0.3, n)
    d[rng.random(n) < 0.3] *= 1e-3
    t = np.minimum(s + d, 0.0)
    on = rng.choice(np.asarray(S.D_EDGES), 40)
    s[:40], t[:40] = np.where(on > 0, -on, 0.0), np.where(on > 0, 0.0, on)
    s[40:42], t[40:42] = [-35.0, -0.5], [-0.5, -45.0]
    entropy = rng.choice(np.asarray(S.ENTROPY_EDGES), n) * rng.choice([1.0, 1.0 + 1e-9, 1.0 - 1e-9], n)
    entropy[rng.random(n) < 0.2] = np.nan
    sv = rng.integers(3, 7, n)
    sv_null = rng.random(n) < 0.1
    order = rng.permutation(n)
    cols = dict(sample=sample, pos=pos, s=s, t=t, entropy=entropy, sv=sv, sv_null=sv_null)
    return {k: v[order] for k, v in cols.items()}


def test_long_format_equals_ingest_with_entropy(tmp_path):
    tok = long_tokens()
    n = len(tok["s"])
    table = pa.table({
        "run": pa.array(["r"] * n), "step": pa.array(np.full(n, 2, np.int64)), "sample": pa.array(tok["sample"]),
        "pos": pa.array(tok["pos"].astype(np.int32)), "sampler_logprob": pa.array(tok["s"]),
        "trainer_logprob": pa.array(tok["t"]),
        "sampler_entropy": pa.array(tok["entropy"], mask=np.isnan(tok["entropy"])),
        "sampler_version": pa.array(tok["sv"], mask=tok["sv_null"]),
        "trainer_version": pa.array(np.full(n, 5, np.int64))})
    pq.write_table(table, tmp_path / "tokens.parquet")
    store = Store(tmp_path / "ref.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "tokens.parquet"])} == {"loaded"}

    samples, seq = np.unique(tok["sample"], return_inverse=True)
    lag, null = 5 - tok["sv"], tok["sv_null"]  # lags −1 .. 2
    lo = int(lag[~null].min())
    n_lag = int(lag[~null].max()) - lo + 1
    acc = K.Accumulators.zeros(len(samples), n_lag)
    half = n // 2  # two calls, as two Arrow batches would make
    for a, b in ((0, half), (half, n)):
        acc.add(tok["s"], tok["t"], pos=tok["pos"], seq=seq, lo=a, hi=b, tok_lag=np.where(null, -1, lag - lo),
                entropy=tok["entropy"])
    got = K.tables(acc, samples, lo, n_lag)
    assert {r["dim"] for r in table_rows(got["summary_bucket"])} == {"prob", "position", "entropy", "lag"}
    for name in TOKEN_TABLES:
        rows = [{"run": "r", "step": 2} | r for r in table_rows(got[name])]
        key = [c.name for c in summary_files.TABLES[name] if S.merge_kind(c.name) == "key"]
        rows.sort(key=lambda r: tuple(r[k] for k in key))
        want = merged(store, name)
        if name == "summary_seq":  # ingest writes n_flip_tokens as null without routing; the log-prob sums
            rows = [r | {"n_flip_tokens": None} for r in rows]  # come from kernel._seq_sums, not the accumulators
            want = [{k: v for k, v in w.items() if k not in S.SEQ_SUM_NAMES} for w in want]
        if name == "summary_step":  # the logging checks', residual signatures' and top-k sums come from
            # summaries/checks.py, residual.py and fulldist.py, not the kernel
            other = S.CHECK_SUM_NAMES + S.RESIDUAL_SUM_NAMES + S.TOPK_SUM_NAMES
            want = [{k: v for k, v in w.items() if k not in other} for w in want]
        assert_same_rows([{k: r.get(k) for k in w} for r, w in zip(rows, want)], want, name)
        assert len(rows) == len(want), name


def test_masked_long_format_equals_the_kept_tokens_alone():
    """Long form with a `valid` mask (masked tokens anywhere, holding NaN and other sequences' ids) gives the rows
    of the same call on the unmasked tokens only, with the tokens in order (long runs with masked tokens inside)."""
    tok = long_tokens()
    order = np.lexsort((tok["pos"], tok["sample"]))
    tok = {k: v[order] for k, v in tok.items()}
    n = len(tok["s"])
    rng = np.random.default_rng(3)
    samples, seq = np.unique(tok["sample"], return_inverse=True)
    valid = rng.random(n) < 0.8
    s, t = tok["s"].copy(), tok["t"].copy()
    s[~valid], t[~valid] = np.nan, np.nan
    # masked tokens: their own sequence's id (a last one masked must not count in max_pos) or any other
    odd_seq = np.where(valid | (rng.random(n) < 0.5), seq, rng.integers(0, len(samples), n))
    lag = np.where(tok["sv_null"], -1, 5 - tok["sv"] + 1)  # lags 0 .. 3, −1: none
    got = K.Accumulators.zeros(len(samples), 4).add(s, t, pos=tok["pos"], seq=odd_seq, valid=valid, tok_lag=lag,
                                                     entropy=tok["entropy"])
    want = K.Accumulators.zeros(len(samples), 4).add(s[valid], t[valid], pos=tok["pos"][valid], seq=seq[valid],
                                                      tok_lag=lag[valid], entropy=tok["entropy"][valid])
    assert_same_tables(K.tables(got, samples, 0, 4), K.tables(want, samples, 0, 4))


def test_bins_on_edges_and_next_to_them():
    """Fine Δ bins of edges, of their neighbouring doubles and of 0, ±inf-far values: 2·#{E < d} + 𝟙[d = E]."""
    e = K.D_EDGES
    d = np.concatenate([e, np.nextafter(e, -np.inf), np.nextafter(e, np.inf), [0.0, -0.0, 1e-300, -1e300, 1e300]])
    s = np.where(d > 0, -d, 0.0)  # t − s = d exactly
    t = np.where(d > 0, 0.0, d)
    assert np.array_equal(t - s, d)
    acc = K.Accumulators.zeros(len(d)).add(s, t, pos=np.zeros(len(d)), seq=np.arange(len(d)))
    hist = K.tables(acc, np.arange(len(d)))["summary_hist"]
    want = np.bincount(K.bin_ids(d, e), minlength=S.N_BINS)
    assert np.array_equal(hist["bin"], np.flatnonzero(want)) and np.array_equal(hist["n_tokens"], want[want > 0])
    below = np.array([sum(x > a for a in S.D_EDGES) for x in d])  # independent of searchsorted
    assert np.array_equal(K.bin_ids(d, e), 2 * below + np.isin(d, e))


def test_compensated_sums_over_a_million_tokens():
    """Step sums over 1M tokens whose Δ nearly cancel (±x pairs plus 1e-6: Σ Δ ≈ 1 against Σ |Δ| ≈ 1.7e5):
    within rel 1e-12 of math.fsum over the same per-token terms, where a plain float64 running sum misses by more."""
    rng = np.random.default_rng(11)
    n = 1 << 20
    x = rng.normal(0.0, 0.2, n // 2)
    d = rng.permutation(np.concatenate([x, -x])) + 1e-6
    s = -rng.exponential(1.0, n) - np.abs(d)
    t = s + d
    d = t - s
    assert abs(np.add.accumulate(d)[-1] / math.fsum(d) - 1) > 1e-12  # the data is hard for a plain sum
    acc = K.Accumulators.zeros(1).add(s, t, pos=np.arange(n) % 4096, seq=np.zeros(n, np.int64))
    step = K.tables(acc, np.zeros(1, np.int64))["summary_step"]
    exact = {"sum_d": d, "sum_rm1": np.expm1(d), "sum_d2": d * d, "sum_qs": -np.expm1(s), "sum_ps": np.exp(s)}
    for col, terms in exact.items():
        want = math.fsum(terms)
        assert math.isclose(step[col][0], want, rel_tol=1e-12), (col, step[col][0], want)
    assert step["n_tokens"] == [n]


def test_per_sequence_sums_ride_the_kernels_pass_to_the_bit():
    """Accumulators.add's seq_sums_out (ingest's per-sequence log-prob sums, from the kernel's chunks): the sums
    np.bincount gives over the same tokens in the same order, bit for bit, with sequences interleaved, chunks of
    the kernel crossed, |Δ| both small and large (log cosh's two forms, r clamped)."""
    rng = np.random.default_rng(11)
    n, n_seq = 3 * K.CHUNK + 17, 57
    seq = np.sort(rng.integers(0, n_seq, n))
    seq[::5] = rng.integers(0, n_seq, len(seq[::5]))  # out of order too
    pos = np.arange(n) % 700
    d = rng.normal(0, 0.5, n)
    d[::97] = rng.choice([-30.0, -3.0, 2.5, 25.0], len(d[::97]))
    s = -rng.exponential(1.0, n) - np.maximum(d, 0.0)
    t = s + d
    out = np.zeros((5, n_seq))
    K.Accumulators.zeros(n_seq).add(s, t, pos=pos, seq=seq, seq_sums_out=out)
    x = np.abs(0.5 * (t - s))
    small = x < 1.0
    js = np.where(small, np.log1p(2.0 * np.sinh(0.5 * x) ** 2),
                  x + np.log1p(np.exp(-2.0 * x)) - math.log(2.0))
    r = np.exp(np.clip(t - s, -20.0, 20.0))
    want = np.stack([np.bincount(seq, minlength=n_seq).astype(float), np.bincount(seq, s, n_seq),
                     np.bincount(seq, t, n_seq), np.bincount(seq, js, n_seq), np.bincount(seq, r * t, n_seq)])
    assert out.tobytes() == want.tobytes()


def test_per_sequence_sums_in_grid_form_to_the_bit():
    """seq_sums_out in grid form (DriftLogger: a token's sequence is its row, the mask keeps the trained ones):
    np.bincount's sums over the trained tokens by row, bit for bit, with rows that cross the kernel's chunks,
    empty rows, NaN at padding, and the rows taken in two calls (two threads' pieces of whole rows)."""
    rng = np.random.default_rng(12)
    B, T = 37, 613  # T does not divide CHUNK: rows cross chunks
    d = rng.normal(0, 0.5, (B, T))
    d[:, ::97] = 25.0
    s = -rng.exponential(1.0, (B, T)) - np.maximum(d, 0.0)
    t = s + d
    mask = rng.random((B, T)) < 0.8
    mask[[3, 20]] = False  # empty rows
    s[~mask], t[~mask] = np.nan, np.nan
    out = np.zeros((5, B))
    acc = K.Accumulators.zeros(B)
    args = dict(s=s.reshape(-1), t=t.reshape(-1), valid=mask.reshape(-1), T=T, seq_sums_out=out)
    acc.add(**args, lo=0, hi=15 * T)
    acc.sharing_sequences().add(**args, lo=15 * T, hi=B * T)
    row = np.nonzero(mask)[0]
    sv, tv = s[mask], t[mask]
    x = np.abs(0.5 * (tv - sv))
    js = np.where(x < 1.0, np.log1p(2.0 * np.sinh(0.5 * x) ** 2), x + np.log1p(np.exp(-2.0 * x)) - math.log(2.0))
    r = np.exp(np.clip(tv - sv, -20.0, 20.0))
    want = np.stack([np.bincount(row, minlength=B).astype(float), np.bincount(row, sv, B), np.bincount(row, tv, B),
                     np.bincount(row, js, B), np.bincount(row, r * tv, B)])
    assert out.tobytes() == want.tobytes()
