"""Reward, advantage, prompt and response beside the drift: analysis.metrics.context.step_context and the sequence
context of analysis.metrics.drilldown, against the seeded records they were loaded from."""
from __future__ import annotations

import math

import numpy as np
import polars as pl
from polars.testing import assert_frame_equal

from analysis.ingest import ingest_paths
from analysis.metrics import context, drilldown
from analysis.store import Store

from helpers.context import make_sequences, write_sequence_jsonl


def _store(tmp_path, seqs, run="ctx") -> Store:
    store = Store(tmp_path / "d.duckdb")
    out = ingest_paths(store, [write_sequence_jsonl(tmp_path / "seqs.jsonl", seqs, run)])
    assert [o.status for o in out] == ["loaded"], out
    return store


def test_step_context_matches_the_records(tmp_path):
    seqs = make_sequences(11, steps=5, per_step=6)
    with _store(tmp_path, seqs) as store:
        df = context.step_context(store, ["ctx"])
        assert df.columns == ["run", "step", *context.CONTEXT_COLUMNS]
        assert df["step"].to_list() == list(range(5))
        for row in df.iter_rows(named=True):
            qs = [q for q in seqs if q["step"] == row["step"]]
            lengths = np.array([len(q["s"]) for q in qs])
            assert row["n_sequences"] == len(qs) and row["n_rewarded"] == len(qs)
            assert math.isclose(row["reward_mean"], np.mean([q["reward"] for q in qs]), rel_tol=1e-12)
            assert math.isclose(row["response_length_mean"], lengths.mean(), rel_tol=1e-12)
            assert math.isclose(row["response_length_std"], lengths.std(ddof=1), rel_tol=1e-12)
            assert (row["response_length_min"], row["response_length_max"]) == (lengths.min(), lengths.max())
        narrowed = context.step_context(store, ["ctx"], steps=(1, 2))
        assert_frame_equal(narrowed, df.filter(pl.col("step").is_between(1, 2)), check_exact=False, rel_tol=1e-12)
        assert context.step_context(store, []).is_empty()


def test_worst_sequences_carry_reward_and_filter_by_it(tmp_path):
    seqs = make_sequences(12, steps=2, per_step=8)
    with _store(tmp_path, seqs) as store:
        everything = drilldown.worst_sequences(store, "ctx", 1, n=100)
        by_sample = {q["sample"]: q for q in seqs if q["step"] == 1}
        for row in everything.iter_rows(named=True):
            q = by_sample[row["sample"]]
            assert (row["reward"], row["response_length"]) == (q["reward"], len(q["s"]))
            assert math.isclose(row["advantage"], q["advantage"], abs_tol=1e-12)
        correct = drilldown.worst_sequences(store, "ctx", 1, n=100, reward_min=1.0)
        wrong = drilldown.worst_sequences(store, "ctx", 1, n=100, reward_max=0.5)
        assert sorted(correct["sample"]) == sorted(s for s, q in by_sample.items() if q["reward"] >= 1)
        assert sorted(wrong["sample"]) == sorted(s for s, q in by_sample.items() if q["reward"] <= 0.5)
        assert correct.height + wrong.height == len(by_sample)
        assert drilldown.step_samples(store, "ctx", 1) == sorted(by_sample)


def test_sequence_context_without_stored_text(metrics_store_from):
    """A long table has no sequences rows: the response is the tokens' text in position order, the rest null."""
    tokens = pl.DataFrame({"run": ["e"] * 3, "step": [0] * 3, "sample": [4] * 3, "pos": [2, 0, 1],
                           "token": ["c", "a", "b"], "sampler_logprob": [-0.1, -0.2, -0.3],
                           "trainer_logprob": [-0.1, -0.25, -0.3]})
    store = metrics_store_from(tokens)
    ctx = drilldown.sequence_context(store, "e", 0, 4)
    got = (ctx["response"], ctx["response_from_tokens"], ctx["response_length"], ctx["n_tokens"])
    assert got == ("abc", True, 3, 3)
    assert ctx["reward"] is None and ctx["prompt"] is None
    assert math.isclose(ctx["seq_log_ratio"], -0.05, abs_tol=1e-12)
    assert drilldown.sequence_context(store, "e", 0, 5) is None
    assert context.step_context(store, ["e"])["n_rewarded"].to_list() == [0]


def test_sequence_context_on_a_database_made_before_response(tmp_path):
    """A viewer opens old databases read-only (no migration): the response then comes from the tokens."""
    import duckdb

    seqs = make_sequences(13, steps=1, per_step=2)
    _store(tmp_path, seqs).close()
    con = duckdb.connect(str(tmp_path / "d.duckdb"))
    con.execute("ALTER TABLE sequences DROP COLUMN response")
    con.close()
    with Store(tmp_path / "d.duckdb", read_only=True) as store:
        ctx = drilldown.sequence_context(store, "ctx", 0, 1)
    q = seqs[1]
    assert (ctx["response"], ctx["response_from_tokens"], ctx["prompt"]) == ("".join(q["tokens"]), True, q["prompt"])
