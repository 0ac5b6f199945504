"""The bundled demo (the drift lab's runs) on the Overview and the Sequences page, headless with AppTest: the
reward panel is drawn from the runs' rewards, and a sample shows its prompt, response text, reward and advantage."""
from __future__ import annotations

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from helpers import ROOT
from helpers.apptest import app_env, errors, open_app, texts

pytestmark = pytest.mark.slow  # whole pages in AppTest


@pytest.fixture(autouse=True)
def _app_env(monkeypatch):
    app_env(monkeypatch)



def test_overview_draws_the_demo_rewards(monkeypatch, demo_db):
    at = open_app(monkeypatch, demo_db, "pages/overview.py")
    assert not at.exception and not errors(at), errors(at)
    assert "logged no reward" not in texts(at.caption)
    at.session_state["overview_context_numbers"] = True  # the chart's numbers, drawn once their expander is open
    table = next(d.value for d in at.run().dataframe if "reward_mean" in d.value.columns)
    runs = at.multiselect(key="sidebar_runs").value
    assert runs and set(table["run"]) == set(runs)
    assert table["reward_mean"].notna().all() and table["n_rewarded"].eq(32).all()
    assert table.groupby("run")["step"].nunique().min() >= 200
    varied = table.assign(v=table["response_length_std"].gt(0)).groupby("run")["v"].mean()
    for run, share in varied.items():  # answers of different lengths in nearly every step, but where geo_rs
        assert share > (0.3 if run == "bf16-async-geo-rs" else 0.95), (run, share)  # made them all run to the limit


def test_sequences_shows_a_demo_sample_as_text(monkeypatch, demo_db):
    """Step 120, sample 5 of bf16, against the summary file's own sequences row."""
    summary = pq.read_table(next((ROOT / "data" / "demo" / "bf16").glob("summary-*.parquet")))
    row = summary.filter(pc.and_(pc.and_(pc.equal(summary["summary"], "sequences"), pc.equal(summary["step"], 120)),
                                 pc.equal(summary["sample"], 5))).to_pylist()[0]
    at = open_app(monkeypatch, demo_db, "pages/sequences.py")
    at.selectbox(key="seq_run").set_value("bf16").run()
    at.number_input(key="seq_step").set_value(120).run()
    at.number_input(key="seq_sample").set_value(5).run()
    assert not at.exception and not errors(at), errors(at)
    shown = [t.value for t in at.text]
    assert row["prompt"] in shown and row["response"] in shown
    metrics = {m.label: m.value for m in at.metric}
    assert float(metrics["reward"]) == pytest.approx(row["reward"], rel=1e-3)
    assert float(metrics["advantage"]) == pytest.approx(row["advantage"], rel=1e-3, abs=1e-3)
