"""The Sequences page's sample view at a glance: the run's p99 |Δ| as its colour scale (against numpy), a prompt's
group of samples (against a brute-force grouping of the seeded prompts) with prev/next, the prompt's token count
where ids were logged, the per-token chart (colours saturating at the scale, Δ or r, the prompt band), and empty
prompt and response boxes drawn as one line. The browser test of a link to a sample is
tests/test_browser_sample_link.py."""
from __future__ import annotations

import json

import numpy as np
import polars as pl
import pytest

from analysis.ingest import ingest_paths
from analysis.metrics import drilldown
from analysis.store import Store
from ui import charts, sequence_view

from helpers.apptest import app_env, open_app
from helpers.browser import app_charts
from helpers.context import make_sequences, write_sequence_jsonl

RUN = "grp"


def grouped(seed: int = 5) -> list[dict]:
    """make_sequences' samples, 6 a step, where samples 2k and 2k+1 share a prompt (a GRPO group of two) except
    sample 4, whose prompt is its own; step 1's sample 5 has an empty prompt and step 2's sample 5 none at all."""
    seqs = make_sequences(seed, steps=3, per_step=6)
    for q in seqs:
        q["prompt"] = f"Step {q['step']} prompt {q['sample'] // 2}" if q["sample"] != 4 else "alone"
        if q["sample"] == 5 and q["step"] == 1:
            q["prompt"] = ""
        if q["sample"] == 5 and q["step"] == 2:
            q["prompt"] = None
    return seqs


@pytest.fixture
def group_db(tmp_path):
    seqs = grouped()
    db = tmp_path / "grp.duckdb"
    with Store(db) as store:
        out = ingest_paths(store, [write_sequence_jsonl(tmp_path / "grp.jsonl", seqs, RUN)])
        assert [o.status for o in out] == ["loaded"], [o.line() for o in out]
    return db, seqs


def test_delta_scale_is_the_runs_p99_abs_delta(group_db):
    db, seqs = group_db
    d = np.concatenate([np.asarray(q["t"]) - np.asarray(q["s"]) for q in seqs])
    with Store(db, read_only=True) as store:
        got = drilldown.delta_scale(store, RUN)
        assert drilldown.delta_scale(store, "no-such-run") is None
    assert got == pytest.approx(float(np.quantile(np.abs(d), 0.99)), rel=1e-9, abs=1e-12)


def test_sample_group_is_the_samples_with_the_same_prompt_at_that_step(group_db):
    db, seqs = group_db
    with Store(db, read_only=True) as store:
        for q in seqs:
            want = sorted(x["sample"] for x in seqs if x["step"] == q["step"] and q["prompt"] is not None
                          and x["prompt"] == q["prompt"])
            assert drilldown.sample_group(store, RUN, q["step"], q["sample"]) == want, (q["step"], q["sample"])
    # the pairs are groups of two, the lone prompt a group of one, no prompt no group
    assert want == [] and seqs[-1]["prompt"] is None


def test_prompt_token_count_only_for_logged_ids():
    assert drilldown.prompt_token_count(json.dumps([151644, 872, 13])) == 3
    assert drilldown.prompt_token_count("[1, 2") is None  # not JSON: text that starts with a bracket
    assert drilldown.prompt_token_count('["a", "b"]') is None
    assert drilldown.prompt_token_count("What is 2 + 2?") is None
    assert drilldown.prompt_token_count(None) is None and drilldown.prompt_token_count("") is None


def _tokens(deltas):
    s = -np.linspace(0.5, 2.0, len(deltas))
    return pl.DataFrame({"pos": np.arange(len(deltas)), "token": [f"w{i}" for i in range(len(deltas))],
                         "token_id": np.arange(len(deltas)), "sampler_logprob": s, "trainer_logprob": s + deltas,
                         "delta": deltas, "ratio": np.exp(deltas)})


def test_the_chart_saturates_at_the_scale_and_shades_the_prompt():
    deltas = np.array([0.001, -0.002, 0.5, 0.6, -0.4, 0.0015])  # a block of three far above the noise
    df = _tokens(deltas)
    fig = charts.sequence_delta(df, "delta", scale=0.01, prompt_tokens=7)
    bar = fig.data[0]
    assert list(bar.y) == pytest.approx(deltas)
    colors = list(bar.marker.color)
    assert colors[2] == colors[3] == charts.diverging_colors([1.0], 1.0)[0]  # full colour at and past the scale
    assert colors[4] == charts.diverging_colors([-1.0], 1.0)[0]
    assert colors[0] == charts.diverging_colors([0.1], 1.0)[0]  # 0.001 of a 0.01 scale: a tenth of the way
    shapes = [s.to_plotly_json() for s in fig.layout.shapes]
    prompt = next(s for s in shapes if s.get("xref") == "x")
    assert (prompt["x0"], prompt["x1"]) == (-7.5, -0.5)
    band = next(s for s in shapes if s.get("yref") == "y")
    assert (band["y0"], band["y1"]) == (-0.01, 0.01)
    assert "prompt (7 tokens" in fig.layout.annotations[0].text
    r = charts.sequence_delta(df, "ratio", scale=0.01)
    assert r.data[0].base == 1.0 and [1 + y for y in r.data[0].y] == pytest.approx(np.exp(deltas))
    assert not [s for s in r.layout.shapes if s.to_plotly_json().get("xref") == "x"]  # no prompt ids, no band
    assert charts.sequence_delta(df).data[0].marker.color == tuple(charts.diverging_colors(list(deltas)))


def test_the_page_opens_on_the_runs_scale_walks_the_group_and_collapses_empty_boxes(monkeypatch, group_db):
    db, seqs = group_db
    with Store(db, read_only=True) as store:
        p99 = drilldown.delta_scale(store, RUN)
    app_env(monkeypatch)
    at = open_app(monkeypatch, db, "pages/sequences.py")
    assert at.session_state["seq_scale"] == sequence_view.default_scale(p99)
    at.number_input(key="seq_step").set_value(1).run()
    at.number_input(key="seq_sample").set_value(2).run()
    assert not at.exception, at.exception
    assert "Response 1 of 2 to this prompt at step 1 (samples 2–3)." in [c.value for c in at.caption]
    assert at.button(key="seq_prev").disabled and not at.button(key="seq_next").disabled
    assert app_charts(at) >= 1
    # the token table is drawn once its expander is opened (a rerun), with the sample's numbers
    assert not [d for d in at.dataframe if "Δ" in d.value.columns]
    at.session_state["seq_numbers"] = True
    at.run()
    q = next(x for x in seqs if x["step"] == 1 and x["sample"] == 2)
    table = next(d.value for d in at.dataframe if "Δ" in d.value.columns)
    np.testing.assert_allclose(table["Δ"], np.asarray(q["t"]) - np.asarray(q["s"]), rtol=0, atol=1e-9)
    at.button(key="seq_next").click().run()
    assert at.session_state["seq_sample"] == 3 and "Sample 3 at step 1" in [h.value for h in at.subheader]
    assert at.button(key="seq_next").disabled and not at.button(key="seq_prev").disabled
    at.button(key="seq_prev").click().run()
    assert at.session_state["seq_sample"] == 2

    at.number_input(key="seq_sample").set_value(4).run()  # a prompt of its own: no group controls
    assert not [b for b in at.button if b.key in ("seq_prev", "seq_next")]
    at.number_input(key="seq_sample").set_value(5).run()  # an empty prompt: one line
    markdown = [m.value for m in at.markdown]
    assert "**Prompt** · *empty*" in markdown and not [b for b in at.button if b.key == "seq_next"]
    at.number_input(key="seq_step").set_value(2).run()
    at.number_input(key="seq_sample").set_value(5).run()
    assert "**Prompt** · *none logged*" in [m.value for m in at.markdown]
    q = next(x for x in seqs if x["step"] == 2 and x["sample"] == 5)
    assert q["response"].strip() in [t.value.strip() for t in at.text]  # a response logged: its box
