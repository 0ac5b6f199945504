"""DriftLogger's context arguments (rewards, advantages, prompts, responses, tags, segment_ids, sampling_support):
checked at the trainer, stored for every sequence whatever the token sample, read back by ingest from the logger's
files, sequence JSON Lines, long tables and a lake; and the residual signatures (METRICS.md v3) they feed, equal
to the numpy reference (tests/helpers/reference.py ref_residual) at rel 1e-12."""
from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from analysis.ingest import ingest_paths
from analysis.metrics import read
from analysis.metrics import token as metrics
from analysis.record.logger import DriftLogger
from analysis.store import Store
from analysis.summaries import finalise as F

from helpers.ingest import summaries_by_sql
from helpers.logger_context import context_step, reference, trained, write_jsonl
from helpers.reference import assert_close, ref_residual

STEPS = (2, 5)


@pytest.fixture(scope="module")
def steps() -> dict[int, dict]:
    return {step: context_step(step) for step in STEPS}


def _loaded(store: Store, path) -> Store:
    outcomes = ingest_paths(store, [path])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    return store


def logged(tmp_path, steps, token_sample: float) -> Store:
    log = DriftLogger(tmp_path / "logs", "r", token_sample=token_sample, worst_sequences=1, top_tokens=4)
    for step, data in steps.items():
        log.log_step(step, **data)
    return _loaded(Store(tmp_path / "logged.duckdb"), tmp_path / "logs")


def assert_residual(store: Store, steps, by: str) -> None:
    df = read.token_table(store, ["r"], by=by)
    ref = reference(steps, by)
    keys = ["run", "step"] if by == "step" else ["run"]
    assert df.height == len(ref)
    for row in df.iter_rows(named=True):
        key = tuple(row[k] for k in keys)
        for col in F.RESIDUAL_COLUMNS:
            assert_close(row[col], ref[key][col], f"{key} {col}")


def test_reference_has_every_case(steps):
    """The data reach every branch: each share is strictly between 0 and 1 somewhere."""
    for by in ("step", "run"):
        for key, cols in reference(steps, by).items():
            for col, v in cols.items():
                assert v is not None and 0 < v < 1, (key, col, v)


@pytest.mark.parametrize("token_sample", [1.0, 0.1, 0.0])
@pytest.mark.parametrize("by", ["step", "run"])
def test_residual_signatures_from_logger_summaries(tmp_path, steps, token_sample, by):
    assert_residual(logged(tmp_path, steps, token_sample), steps, by)


@pytest.mark.parametrize("by_sql", [False, True])
def test_residual_signatures_from_jsonl(tmp_path, monkeypatch, steps, by_sql):
    """The same steps as sequence JSON Lines: ingest's stream (or its SQL fallback) gives the same columns, and
    the token rows give them too (the token-level path, also for another quantum q)."""
    summaries_by_sql(monkeypatch, by_sql)
    store = _loaded(Store(tmp_path / "j.duckdb"), write_jsonl(tmp_path / "seqs.jsonl", "r", steps))
    for by in ("step", "run"):
        assert_residual(store, steps, by)
        rows = metrics.residual_metrics(store, ["r"], by=by)
        ref = reference(steps, by)
        for row in rows.iter_rows(named=True):
            key = ("r", row["step"]) if by == "step" else ("r",)
            for col in F.RESIDUAL_COLUMNS:
                assert_close(row[col], ref[key][col], f"tokens {key} {col}")
    x = trained(STEPS[0], steps[STEPS[0]])
    want = ref_residual(x["t"] - x["s"], x["pos"].tolist(), x["sample"].tolist(), x["segment"].tolist(), q=0.25)
    got = metrics.residual_metrics(store, ["r"], by="step", q=0.25).row(0, named=True)
    assert_close(got["lattice_share_q"], want["lattice_share_q"], "q = 0.25")
    assert got["lattice_share_q"] != reference(steps, "step")[("r", STEPS[0])]["lattice_share_q"]


def test_residual_signatures_from_lake(tmp_path, steps):
    from analysis.lake.summarize import summarize

    log = DriftLogger(tmp_path / "lake", "r", layout="lake")
    for step, data in steps.items():
        log.log_step(step, **data)
    report = summarize(str(tmp_path / "lake"), tmp_path / "out", progress=False)
    assert report.ok, report
    store = _loaded(Store(tmp_path / "lake.duckdb"), tmp_path / "out")
    for by in ("step", "run"):
        assert_residual(store, steps, by)
    assert_sequences(store, steps)


def assert_sequences(store: Store, steps) -> None:
    """Every sequence of every step has its reward, advantage (null for the row whose per-token advantages
    differ), prompt, response and tag, as given."""
    got = {(r["step"], r["sample"]): r for r in store.sql("SELECT * FROM sequences").iter_rows(named=True)}
    n = 0
    for step, data in steps.items():
        adv = data["advantages"].numpy()
        for b, sample in enumerate(data["sample_ids"].tolist()):
            row = got[(step, sample)]
            n += 1
            assert row["reward"] == float(data["rewards"][b])
            assert row["advantage"] == (None if b == 1 else float(adv[b, 0]))
            assert (row["prompt"], row["response"], row["tag"]) == (data["prompts"][b], data["responses"][b],
                                                                   data["tags"][b])
    assert len(got) == n


@pytest.mark.parametrize("token_sample", [1.0, 0.1, 0.0])
def test_sequences_and_token_columns_stored(tmp_path, steps, token_sample):
    store = logged(tmp_path, steps, token_sample)
    assert_sequences(store, steps)
    tokens = store.sql("SELECT step, sample, pos, advantage, segment, sampling_support FROM tokens")
    assert tokens.height == (0 if token_sample == 0.0 else tokens.height)
    if token_sample == 1.0:
        assert tokens.height == sum(int(d["mask"].sum()) for d in steps.values())
    for row in tokens.iter_rows(named=True):
        data = steps[row["step"]]
        b = data["sample_ids"].tolist().index(row["sample"])
        assert row["segment"] == int(data["segment_ids"][b, row["pos"]])
        assert row["sampling_support"] == int(data["sampling_support"][b, row["pos"]])
        assert row["advantage"] == float(data["advantages"][b, row["pos"]])


def test_prompt_token_ids_and_partial_lists(tmp_path):
    """Prompt ids ([B, P] or ragged lists) are kept as the JSON text of the ids; None marks a missing value."""
    data = context_step(0, B=3, T=6)
    log = DriftLogger(tmp_path / "a", "a")
    log.log_step(0, **(data | {"prompts": torch.tensor([[5, 6, 7], [8, 9, 10], [0, 1, 2]]),
                              "rewards": [1.0, None, 0.5], "tags": ["x", None, "z"], "responses": None,
                              "advantages": None}))
    log = DriftLogger(tmp_path / "b", "b")
    log.log_step(0, **(data | {"prompts": [[5], [], [6, 7]], "advantages": np.array([0.5, -0.5, 0.0]),
                              "rewards": None}))
    store = _loaded(Store(tmp_path / "db.duckdb"), tmp_path)
    rows = store.sql("SELECT run, prompt, reward, advantage, response, tag FROM sequences ORDER BY run, sample").rows()
    assert rows[:3] == [("a", "[5, 6, 7]", 1.0, None, None, "x"), ("a", "[8, 9, 10]", None, None, None, None),
                        ("a", "[0, 1, 2]", 0.5, None, None, "z")]
    assert [r[1:4] for r in rows[3:]] == [("[5]", None, 0.5), ("[]", None, -0.5), ("[6, 7]", None, 0.0)]


def test_without_context_no_sequences_rows(tmp_path):
    data = {k: v for k, v in context_step(0, B=3, T=6).items() if k in (
        "sampler_logprobs", "trainer_logprobs", "mask")}
    paths = DriftLogger(tmp_path / "l", "r").log_step(0, **data)
    table = pq.read_table(paths["summary"])
    assert "sequences" not in table.column("summary").to_pylist()
    assert not {"advantage", "segment", "sampling_support"} & set(pq.read_schema(paths["tokens"]).names)
    store = _loaded(Store(tmp_path / "db.duckdb"), tmp_path / "l")
    row = read.token_table(store, ["r"], by="run").row(0, named=True)
    assert row["boundary_low_share"] is None and row["elsewhere_low_share"] is None
    assert row["lattice_share_q"] is not None


# -- refusals at the trainer ------------------------------------------------------------------------------

B, T = 3, 6
BAD_ARGS = [
    ({"rewards": [1.0, 2.0]}, r"rewards: expected 3 values \(one per sequence, shape \[3\]\), got 2"),
    ({"rewards": torch.ones(3, 2)}, r"rewards: expected shape \[3\], got \[3, 2\]"),
    ({"rewards": [1.0, float("nan"), 0.0]}, r"rewards\[1\] = nan: a reward must be finite"),
    ({"rewards": torch.tensor([0.0, 0.0, float("inf")])}, r"rewards\[2\] = inf: a reward must be finite"),
    ({"rewards": [1.0, "a", 0.0]}, r"rewards\[1\]: expected a number or None, got str"),
    ({"advantages": torch.ones(3, 6, 2)}, r"advantages: expected shape \[3\] or \[3, 6\], got \[3, 6, 2\]"),
    ({"advantages": torch.ones(3, 5)}, r"advantages: expected shape \[3, 6\], got \[3, 5\]"),
    ({"advantages": torch.full((3, 6), float("nan"))}, r"advantages\[0, 0\] = nan: an advantage must be finite"),
    ({"prompts": ["a", "b"]}, r"prompts: expected 3 strings \(one per sequence\), got 2"),
    ({"prompts": "abc"}, r"prompts: expected a list of 3 strings"),
    ({"prompts": torch.ones(2, 4, dtype=torch.long)}, r"prompts: expected 3 strings or prompt token ids of shape "
                                                       r"\[3, P\], got shape \[2, 4\]"),
    ({"prompts": [[1, 2], [-1], [3]]}, r"prompts\[1\]: token ids are >= 0, got -1"),
    ({"prompts": [[1.5], [2], [3]]}, r"prompts\[0\]: expected a string or a list of token ids"),
    ({"responses": ["a", 3, "c"]}, r"responses\[1\]: expected a string or None, got int"),
    ({"tags": ["a", "b"]}, r"tags: expected 3 strings \(one per sequence\), got 2"),
    ({"segment_ids": torch.zeros(3, 5, dtype=torch.long)}, r"segment_ids: expected shape \[3, 6\], got \[3, 5\]"),
    ({"segment_ids": torch.full((3, 6), -1)}, r"segment_ids\[0, 0\] = -1: a segment \(turn index\) must be >= 0 "
                                              r"at a trained token"),
    ({"segment_ids": torch.full((3, 6), 0.5)}, r"segment_ids\[0, 0\] = 0.5: expected whole numbers"),
    ({"sampling_support": torch.zeros(3, 6, dtype=torch.long)}, r"sampling_support\[0, 0\] = 0: the sampler's "
                                                                r"support holds at least the sampled token"),
    ({"sampling_support": np.ones((6, 3))}, r"sampling_support: expected shape \[3, 6\], got \[6, 3\]"),
]


@pytest.mark.parametrize("bad, message", BAD_ARGS)
def test_bad_context_is_refused_before_any_file(tmp_path, bad, message):
    s = -torch.rand(B, T, dtype=torch.float64) - 0.1
    log = DriftLogger(tmp_path / "l", "r")
    with pytest.raises(ValueError, match=message):
        log.log_step(0, s, s, torch.ones(B, T), **bad)
    assert sorted(p.name for p in (tmp_path / "l" / "r").iterdir()) == ["run.json"]


def test_padding_context_is_not_checked(tmp_path):
    """Per-token values at untrained positions may hold anything (padding)."""
    s = -torch.rand(B, T, dtype=torch.float64) - 0.1
    mask = torch.ones(B, T)
    mask[:, -1] = 0
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[:, -1] = -7
    adv = torch.zeros(B, T, dtype=torch.float64)
    adv[:, -1] = float("nan")
    paths = DriftLogger(tmp_path / "l", "r").log_step(0, s, s, mask, segment_ids=seg, advantages=adv,
                                                      sampling_support=seg + 1)
    assert pq.read_table(paths["tokens"]).num_rows == B * (T - 1)


# -- refusals at ingest ------------------------------------------------------------------------------------

def _line(**extra) -> dict:
    return {"run": "r", "step": 0, "sample": 0, "sampler_logprobs": [-1.0, -2.0, -0.5],
            "trainer_logprobs": [-1.1, -2.0, -0.4]} | extra


@pytest.mark.parametrize("extra, place, rule", [
    ({"reward": float("nan")}, "line 2 (step 0, sample 0), column 'reward'", "a reward must be a finite number"),
    ({"segment_ids": [0, 1]}, "line 2 (step 0, sample 0)", "'segment_ids' has 2 values but 'sampler_logprobs' has 3"),
    ({"sampling_support": [1, 2, 3, 4]}, "line 2 (step 0, sample 0)", "'sampling_support' has 4 values"),
    ({"advantage": [0.5, 0.5]}, "line 2 (step 0, sample 0)", "'advantage' has 2 values"),
    ({"segment_ids": [0, -1, 1]}, "line 2 (step 0, sample 0, token 1), column 'segment'",
     "a segment (turn index) must be >= 0"),
    ({"sampling_support": [1, 0, 3]}, "line 2 (step 0, sample 0, token 1), column 'sampling_support'",
     "the sampler's support holds at least the sampled token"),
    ({"advantage": [0.5, float("inf"), 0.5]}, "line 2 (step 0, sample 0, token 1), column 'advantage'",
     "an advantage must be a finite number"),
    ({"advantage": float("-inf")}, "line 2 (step 0, sample 0), column 'advantage'",
     "an advantage must be a finite number"),
])
def test_bad_jsonl_context_is_refused(tmp_path, extra, place, rule):
    f = tmp_path / "bad.jsonl"
    good = _line(sample=1, reward=1.0)
    f.write_text(json.dumps(good) + "\n" + json.dumps(_line(**extra)) + "\n")
    store = Store(tmp_path / "db.duckdb")
    (outcome,) = ingest_paths(store, [f])
    assert outcome.status == "refused"
    assert "bad.jsonl" in outcome.message and place in outcome.message and rule in outcome.message, outcome.message
    assert store.scalar("SELECT count(*) FROM sequences") == 0 and store.scalar("SELECT count(*) FROM tokens") == 0


def test_long_tables_carry_the_columns(tmp_path):
    """A long token table with advantage, segment and sampling_support, and a long sequences table (Parquet,
    CSV, JSON Lines) with reward .. tag, load into the same columns; a bad value is refused at its row."""
    tokens = pa.table({"run": ["r"] * 3, "step": [0] * 3, "sample": [0, 0, 1], "pos": [0, 1, 0],
                       "sampler_logprob": [-1.0, -0.5, -2.0], "trainer_logprob": [-1.0, -0.4, -2.5],
                       "advantage": [0.5, 0.5, -1.0], "segment": [0, 1, 0], "sampling_support": [3, 1, 40]})
    pq.write_table(tokens, tmp_path / "tokens.parquet")
    (tmp_path / "seqs.csv").write_text("run,step,sample,reward,advantage,prompt,response,tag\n"
                                       "r,0,0,1.0,0.5,hi,there,math\nr,0,1,0.0,-1.0,a,b,code\n")
    store = _loaded(Store(tmp_path / "db.duckdb"), tmp_path)
    assert store.sql("SELECT sample, pos, advantage, segment, sampling_support FROM tokens ORDER BY ALL").rows() == [
        (0, 0, 0.5, 0, 3), (0, 1, 0.5, 1, 1), (1, 0, -1.0, 0, 40)]
    assert store.sql("SELECT sample, reward, advantage, prompt, response, tag FROM sequences ORDER BY ALL").rows() == [
        (0, 1.0, 0.5, "hi", "there", "math"), (1, 0.0, -1.0, "a", "b", "code")]
    row = read.token_table(store, ["r"], by="run").row(0, named=True)
    # segments: (0, 0) first, (0, 1) first at pos 1, (1, 0) first with Δ = −0.5: no low token, none elsewhere
    assert row["boundary_low_share"] == 0.0 and row["elsewhere_low_share"] is None
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "seqs.csv").write_text("run,step,sample,reward\nq,0,0,1.0\nq,0,1,nan\n")
    (outcome,) = ingest_paths(store, [bad / "seqs.csv"])
    assert outcome.status == "refused" and "row 2, column 'reward'" in outcome.message, outcome.message
    assert "a reward must be a finite number, got nan" in outcome.message
    pq.write_table(tokens.set_column(8, "sampling_support", pa.array([3, 1, 0])), bad / "t.parquet")
    (outcome,) = ingest_paths(store, [bad / "t.parquet"])
    assert outcome.status == "refused" and "row 3, column 'sampling_support'" in outcome.message, outcome.message


def test_old_database_gains_the_columns(tmp_path):
    """A database made before the context columns: opened for writing, it gains them (null in its rows)."""
    import duckdb

    path = tmp_path / "old.duckdb"
    Store(path).close()
    con = duckdb.connect(str(path))
    for table, col in (("sequences", "tag"), ("token_rows_full", "segment"), ("token_rows_full", "advantage"),
                       ("token_rows_full", "sampling_support"), ("sequences", "response")):
        con.execute(f"ALTER TABLE {table} DROP COLUMN {col}")
    con.execute("DROP VIEW tokens")
    con.close()
    store = Store(path)
    assert store.has_columns("tokens", ["advantage", "segment", "sampling_support"])
    assert store.has_columns("sequences", ["tag", "response"])
    assert math.isfinite(len(store.sql("SELECT segment, tag FROM tokens, sequences").columns))
