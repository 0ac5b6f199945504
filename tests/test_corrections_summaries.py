"""Corrections from the per-sequence summaries (analysis/summaries/corrections.py): against the numpy reference of
test_corrections.py when a sequence's tokens come in two files and when DriftLogger kept only a sample of the
token rows, against the token rows on thresholds exactly on a band edge and beyond the clamp, and which
parameters need token rows at all."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from analysis.ingest import ingest_paths
from analysis.metrics import corrections as C
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries import schema as S

from helpers.corrections import CHOICES, check, ref_corrections, seq_table_keys
from helpers.data import metrics_make_tokens
from helpers.reference import assert_close

SUMMARISED = [(m, p) for m, p in CHOICES if not C.reads_tokens(m, p)]


def ingest(store: Store, paths) -> None:
    outcomes = ingest_paths(store, paths)
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]


def no_rewards(tokens: pl.DataFrame) -> dict:
    return {k: (None, None) for k in seq_table_keys(tokens)}


def test_which_parameters_need_token_rows():
    # tis always: its weights min(r, C) are not clamped below (Σ w² from band sums would cancel where r << 1)
    assert [m for m, p in CHOICES if C.reads_tokens(m, p)] == ["tis"] * 3 + ["verl_rs"] * 4
    assert C.reads_tokens("tis", {"C": 1e12}) and C.reads_tokens("tis", {"C": 5.0})
    assert not C.reads_tokens("icepop", {"alpha": 0.8, "beta": 1.25})  # ln 0.8 = log1p(−0.2) up to the last bit
    assert C.reads_tokens("icepop", {"alpha": 0.6})
    assert not C.reads_tokens("icepop", {"alpha": 1e-12, "beta": 1e12})  # beyond the clamp: masks nothing
    assert not C.reads_tokens("icepop", {"alpha": 0.9, "beta": 1.1})  # ln 1.1 = log1p(0.1) up to 5 ulp
    for method, params in (("geo_rs", {"lo": 0.9871, "hi": 1.0123}), ("seq_rs", {"lo": 0.33, "hi": 7.7}),
                           ("veto", {"tau": 3.3e-3})):
        assert not C.reads_tokens(method, params)  # sequence rules: per-sequence aggregates, any parameters
    assert C.log_threshold(0.8) == math.log1p(-0.2) and C.log_threshold(0.6) == math.log(0.6)


def test_parameters_off_the_bands_read_token_rows(tmp_path):
    """auto: one choice from the token rows, the other from the summaries, stacked in the order chosen."""
    tokens = metrics_make_tokens(seed=2, runs=("a",), steps=(0, 1), n_seq=6, optional=False)
    tokens.write_parquet(tmp_path / "t.parquet")
    store = Store(tmp_path / "db.duckdb")
    ingest(store, [tmp_path / "t.parquet"])
    choices = [("icepop", {"alpha": 0.6, "beta": 1.4}), ("tis", {}), ("tis", {"C": 1.4})]
    sim = C.compare_methods(store, "a", choices)["step"]
    for method, params in choices:
        mine = sim.filter((pl.col("method") == method) & (pl.col("params") == C.json.dumps(C.resolve_params(method, params))))
        check(mine, ref_corrections(tokens, no_rewards(tokens), method, params, ["run", "step"]), ["run", "step"],
              method, params)
    assert sim["method"].to_list() == ["icepop", "icepop", "tis", "tis", "tis", "tis"]
    with pytest.raises(ValueError, match="not clamped below"):
        C.corrections(store, "a", "tis", {"C": 2.0}, source="summaries")
    with pytest.raises(ValueError, match="band edges"):
        C.corrections(store, "a", "icepop", {"alpha": 0.6}, source="summaries")
    with pytest.raises(ValueError, match="source must be"):
        C.corrections(store, "a", "tis", source="rows")


def test_a_sequence_split_across_files(tmp_path):
    """Each sequence's first 5 tokens in one file, the rest in another: its summary rows merge per sequence."""
    tokens = metrics_make_tokens(seed=31, steps=(0, 1), n_seq=8, optional=False)
    tokens.filter(pl.col("pos") < 5).write_parquet(tmp_path / "head.parquet")
    tokens.filter(pl.col("pos") >= 5).write_parquet(tmp_path / "tail.parquet")
    store = Store(tmp_path / "db.duckdb")
    ingest(store, [tmp_path / "head.parquet", tmp_path / "tail.parquet"])
    split = store.scalar("SELECT count(*) FROM (SELECT 1 FROM summary_seq GROUP BY run, step, sample "
                         "HAVING count(DISTINCT file_id) = 2)")
    assert split > 10  # the merge is exercised
    for method, params in SUMMARISED:
        for by, keys in (("step", ["run", "step"]), ("run", ["run"])):
            df = C.corrections(store, ["a", "b"], method, params, by=by, source="summaries")
            check(df, ref_corrections(tokens, no_rewards(tokens), method, params, keys), keys, method, params)


def test_a_sampled_logger_run_counts_every_token(tmp_path):
    """DriftLogger keeping 5% of token rows: the summaries still answer for every token; the token rows do not."""
    g = torch.Generator().manual_seed(7)
    B, T, frames = 16, 40, []
    log = DriftLogger(tmp_path / "logs", "r", token_sample=0.05, worst_sequences=1, top_tokens=4)
    for step in range(3):
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
        s = -torch.rand(B, T, generator=g, dtype=torch.float64) * 5
        d = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
        d[torch.rand(B, T, generator=g) < 0.02] -= 12.0  # r < 1e-4: the veto
        t = (s + d).clamp(max=0.0)
        log.log_step(step, s, t, mask)
        for b in range(B):
            n = int(lengths[b])
            frames.append(pl.DataFrame({"run": "r", "step": step, "sample": b, "pos": np.arange(n),
                                        "sampler_logprob": s[b, :n].numpy(), "trainer_logprob": t[b, :n].numpy()}))
    tokens = pl.concat(frames)
    store = Store(tmp_path / "db.duckdb")
    ingest(store, [tmp_path / "logs"])
    assert store.scalar("SELECT count(*) FROM tokens") < tokens.height // 4
    for method, params in SUMMARISED:
        df = C.corrections(store, "r", method, params, by="step")
        check(df, ref_corrections(tokens, no_rewards(tokens), method, params, ["run", "step"]), ["run", "step"],
              method, params)
    rows = C.corrections(store, "r", "icepop", by="run", source="tokens").row(0, named=True)
    assert rows["n_tokens"] < tokens.height  # the token path sees the sample only


def test_thresholds_on_a_band_edge_and_beyond_the_clamp(tmp_path):
    """Δ exactly ln 0.5, ln 5 and ln 2 (icepop's default thresholds, the ESS clamp), and |Δ| > 20: token rows and
    summaries compare Δ with the same ln in log space, so they mask exactly the same tokens."""
    ln = math.log
    # (s, t) pairs whose difference t − s is exactly the wanted Δ
    pairs = [(0.0, ln(0.5)), (-ln(5.0), 0.0), (-ln(2.0), 0.0), (0.0, -25.0), (-30.0, -4.0), (-1.0, -1.0),
             (-0.5, -0.75), (-3.0, -0.2), (0.0, ln(0.5)), (-ln(5.0), -1e-300)]
    s, t = zip(*pairs)
    assert t[0] - s[0] == ln(0.5) and t[1] - s[1] == ln(5.0) and t[2] - s[2] == ln(2.0)
    tokens = pl.DataFrame({"run": "e", "step": [0] * 6 + [1] * 4, "sample": [0, 0, 0, 1, 1, 1, 0, 0, 1, 1],
                           "pos": [0, 1, 2, 0, 1, 2, 0, 1, 0, 1], "sampler_logprob": s, "trainer_logprob": t})
    tokens.write_parquet(tmp_path / "edge.parquet")
    store = Store(tmp_path / "db.duckdb")
    ingest(store, [tmp_path / "edge.parquet"])
    choices = [("icepop", {}), ("icepop", {"alpha": 1e-12, "beta": 1e12}),
               ("icepop", {"alpha": math.exp(-20.0), "beta": 2.0}), ("icepop", {"alpha": 0.8, "beta": 1.25}),
               ("veto", {"tau": 0.5}), ("seq_rs", {"lo": 0.5, "hi": 2.0}), ("geo_rs", {"lo": 0.9, "hi": 1.1})]
    for by in ("step", "run"):
        summ = C.compare_methods(store, "e", choices, source="summaries")[by]
        toks = C.compare_methods(store, "e", choices, source="tokens")[by]
        assert summ.select("method", "params", "n_tokens", "n_sequences").equals(
            toks.select("method", "params", "n_tokens", "n_sequences"))
        for got, want in zip(summ.iter_rows(named=True), toks.iter_rows(named=True)):
            for col in C.COLUMNS[4:]:
                assert_close(got[col], want[col], f"{by} {got['method']} {got['params']} {col}")
    # by hand, step 0: icepop masks Δ = −25 and 26 (clamped to ∓20) only; Δ = ln 0.5 and ln 5 sit on the band and are kept
    row = C.corrections(store, "e", "icepop", by="step", source="summaries").row(0, named=True)
    assert row["masked_token_frac"] == 2 / 6 and row["masked_seq_frac"] == 1 / 2


# -- property: the two sources agree on any data ----------------------------------------------------------------

EDGES_IN_CLAMP = [e for e in S.BAND_EDGES if abs(e) < S.CLAMP]
on_edge = st.sampled_from([math.exp(e) for e in EDGES_IN_CLAMP])  # thresholds the summaries answer
delta = st.one_of(st.floats(-30.0, 30.0, allow_nan=False), st.sampled_from(list(S.BAND_EDGES)))


@pytest.fixture(scope="module")
def prop_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("corr_props")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.lists(st.tuples(delta, st.integers(0, 3), st.integers(0, 1)), min_size=1, max_size=40),
       a=on_edge, b=on_edge, tau=st.floats(1e-9, 3.0))
def test_token_rules_from_summaries_equal_token_rows(prop_dir, data, a, b, tau):
    """icepop and veto with thresholds on the band edges, on Δ anywhere (on edges too, beyond the clamp):
    the summaries mask exactly the tokens and sequences the token rows do, and their weights agree to rounding.
    Δ is exact: s = 0, t = Δ below 0; t = 0, s = −Δ above."""
    assume(a != b)
    d = [x for x, _, _ in data]
    s = [0.0 if x <= 0 else -x for x in d]
    t = [x if x <= 0 else 0.0 for x in d]
    samples, steps = [k for _, k, _ in data], [st_ for _, _, st_ in data]
    pos = [sum(1 for j in range(i) if (samples[j], steps[j]) == (samples[i], steps[i])) for i in range(len(d))]
    f = prop_dir / f"p{len(list(prop_dir.glob('*.parquet')))}.parquet"
    pl.DataFrame({"run": "p", "step": steps, "sample": samples, "pos": pos, "sampler_logprob": s,
                  "trainer_logprob": t}).write_parquet(f)
    store = Store(f.with_suffix(".duckdb"))
    try:
        ingest(store, [f])
        choices = [("icepop", {"alpha": min(a, b), "beta": max(a, b)}), ("veto", {"tau": tau})]
        assert not any(C.reads_tokens(m, p) for m, p in choices)
        for by in ("step", "run"):
            summ = C.compare_methods(store, "p", choices, source="summaries")[by]
            toks = C.compare_methods(store, "p", choices, source="tokens")[by]
            exact = ["method", "params", "n_tokens", "n_sequences", "masked_token_frac", "masked_seq_frac"]
            assert summ.select(exact).equals(toks.select(exact))
            for got, want in zip(summ.iter_rows(named=True), toks.iter_rows(named=True)):
                for col in ("weight_mean", "ess_after"):
                    assert (got[col] is None) == (want[col] is None), (col, got, want)
                    if want[col] is not None:
                        assert abs(got[col] - want[col]) <= rounding_bound(want, col), (col, got, want)
    finally:
        store.close()


EPS = 2.0 ** -52


def rounding_bound(row: dict, col: str) -> float:
    """How far the summaries' weight columns may be from the token rows' (analysis/summaries/corrections.py):
    a band's Σ r = n + Σ(r − 1) carries an absolute error of a few ε per token, relative 1e-16 where weights
    are near 1 and more where nearly every kept r is far below 1; weight_mean = Σ r / n is therefore off by at
    most 4ε(2 + weight_mean). The ESS weights are clamped to [1/2, 2]: rel 1e-12."""
    if col == "weight_mean":
        return 1e-12 * abs(row[col]) + 4 * EPS * (2 + abs(row[col]))
    return 1e-12 * abs(row[col])
