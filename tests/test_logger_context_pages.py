"""The pages on a run logged through DriftLogger with its context (tests/helpers/logger_context.py): reward,
advantage, prompt, response and tag on Sequences (also for a summaries-only run), the advantage beside the reward
on Overview, tags as a grouping and a filter and turns as a grouping in Token drift (AppTest; the browser test is
tests/test_browser_logger_context.py), and the numbers those read against the steps they were logged from."""
from __future__ import annotations

import math

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest

from analysis.ingest import ingest_paths
from analysis.metrics import buckets, context
from analysis.record.logger import DriftLogger
from analysis.store import Store

from helpers.apptest import app_env, open_tab, pick_table
from helpers.logger_context import TAGS, context_step, trained
from helpers.reference import assert_close, ref_token_metrics

STEPS = (2, 5)


def logged(tmp_path, token_sample: float) -> Store:
    log = DriftLogger(tmp_path / "logs", "ctx", token_sample=token_sample, worst_sequences=1, top_tokens=3)
    for step in STEPS:
        log.log_step(step, **context_step(step))
    store = Store(tmp_path / "ctx.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    return store


def test_step_context_has_reward_and_advantage(tmp_path):
    with logged(tmp_path, 0.0) as store:
        df = context.step_context(store, ["ctx"])
    for row, step in zip(df.iter_rows(named=True), STEPS):
        data = context_step(step)
        adv = [float(data["advantages"][b, 0]) for b in range(10) if b != 1]  # row 1's advantages differ by token
        assert row["n_rewarded"] == 10 and row["n_advantaged"] == 9
        assert_close(row["reward_mean"], float(np.mean(data["rewards"].numpy())), "reward_mean")
        assert_close(row["advantage_mean"], float(np.mean(adv)), "advantage_mean")
        assert (row["advantage_min"], row["advantage_max"]) == (min(adv), max(adv))


def test_tags_and_turns_group_the_mismatch(tmp_path):
    """By tag (from the summaries, exact at token_sample 0) and by turn (token rows), each bucket's kl_k3 and
    |Δ| equal numpy over its tokens; a tag filter keeps that tag's tokens only."""
    with logged(tmp_path, 1.0) as store:
        x = {k: np.concatenate([trained(s, context_step(s))[k] for s in STEPS]) for k in
             ("step", "sample", "s", "t", "segment")}
        tag_of = {(s, int(context_step(s)["sample_ids"][b])): TAGS[b % 3] for s in STEPS for b in range(10)}
        tags = np.array([tag_of[(int(a), int(b))] for a, b in zip(x["step"], x["sample"])])
        assert buckets.run_tags(store, ["ctx"]) == sorted(TAGS) and buckets.has_segments(store, ["ctx"])
        seq = np.array([f"{a}/{b}" for a, b in zip(x["step"], x["sample"])])
        for dim, label_of, values in (("tag", str, tags), ("segment", lambda v: f"turn {v}", x["segment"])):
            df = buckets.mismatch_by(store, ["ctx"], dim)
            assert df["label"].to_list() == [label_of(v) for v in sorted(set(values.tolist()))]
            for row in df.iter_rows(named=True):
                m = np.array([label_of(v) == row["label"] for v in values.tolist()])
                ref = ref_token_metrics(x["s"][m], x["t"][m], seq[m])
                assert row["n_tokens"] == ref["n_tokens"]
                for col in ("kl_k3", "log_ratio_abs_mean", "clip_frac", "ratio_frac_high"):
                    assert math.isclose(row[col], ref[col], rel_tol=1e-12), (dim, row["label"], col)
        only = buckets.mismatch_by(store, ["ctx"], "prob", tags=["math"])
        assert only["n_tokens"].sum() == int((tags == "math").sum())
        by_length = buckets.mismatch_by(store, ["ctx"], "length", tags=["math", "chat"])
        assert by_length["n_tokens"].sum() == int(np.isin(tags, ["math", "chat"]).sum())


# -- the pages -----------------------------------------------------------------------------------------------

def open_page(monkeypatch, db, page: str) -> AppTest:
    from helpers.apptest import APP, TIMEOUT
    app_env(monkeypatch)
    monkeypatch.setenv("DRIFT_DB", str(db))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    at.switch_page(page).run()
    assert not at.exception, at.exception
    return at


def drawn(monkeypatch) -> dict:
    """{key: figure} of every chart the pages draw (ui.plot.chart, looked up at each call), from now on."""
    from ui import plot

    figures = {}

    def record(build, *args, key, **kwargs):
        figures[key] = fig = build(*args, **kwargs)
        plot.show(fig, key)
    monkeypatch.setattr(plot, "chart", record)
    return figures


@pytest.mark.slow  # whole pages in AppTest
def test_sequences_page_shows_the_context_of_a_summaries_only_run(tmp_path, monkeypatch):
    logged(tmp_path, 0.0).close()
    data = context_step(STEPS[0])
    at = open_page(monkeypatch, tmp_path / "ctx.duckdb", "pages/sequences.py")
    at.session_state["seq_step"] = STEPS[0]
    at.run()
    sample = int(at.session_state["seq_sample"]) if at.session_state["seq_sample"] is not None else None
    sample = sample if sample is not None else int(pick_table(at)["sample"][0])
    b = data["sample_ids"].tolist().index(sample)
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["reward"] == f"{float(data['rewards'][b]):.4g}", metrics
    assert metrics["advantage"] == (f"{float(data['advantages'][b, 0]):.4g}" if b != 1 else "—"), metrics
    shown = "\n".join(t.value for t in at.text)
    assert data["prompts"][b] in shown and data["responses"][b] in shown
    assert any(TAGS[b % 3] in h.value for h in at.subheader), [h.value for h in at.subheader]
    assert any("none of its token rows was kept" in i.value for i in at.info)


@pytest.mark.slow
def test_overview_draws_the_advantage_beside_the_reward(tmp_path, monkeypatch):
    logged(tmp_path, 0.1).close()
    figures = drawn(monkeypatch)
    open_page(monkeypatch, tmp_path / "ctx.duckdb", "pages/overview.py")
    from ui.context_charts import ADVANTAGE, REWARD
    titles = [a.text for a in figures["overview_context"].layout.annotations]
    assert REWARD in titles and ADVANTAGE in titles, titles


@pytest.mark.slow
def test_token_drift_groups_by_tag_and_turn(tmp_path, monkeypatch):
    logged(tmp_path, 0.1).close()
    at = open_page(monkeypatch, tmp_path / "ctx.duckdb", "pages/token_drift.py")
    at = open_tab(at, "tokens_tab", "Where the mismatch lives")
    assert not at.exception, at.exception
    figures = drawn(monkeypatch)
    at.session_state["tokens_dim"] = "tag"
    at.run()
    assert not at.exception, at.exception
    assert list(figures["tokens_bucket_chart"].data[0].x) == sorted(TAGS)
    (tags,) = [m for m in at.multiselect if m.key == "tokens_tags"]
    assert list(tags.options) == sorted(TAGS)
    tags.set_value(["math"]).run()
    assert not at.exception, at.exception
    assert list(figures["tokens_bucket_chart"].data[0].x) == ["math"]
    at.session_state["tokens_dim"] = "segment"
    at.run()
    assert not at.exception, at.exception
    assert list(figures["tokens_bucket_chart"].data[0].x)[:2] == ["turn 0", "turn 1"]
    assert any("Read from the token rows" in c.value for c in at.caption), [c.value for c in at.caption]
