"""Runs logged with a token sample: the finalised METRICS.md columns still equal the token-level computation over
every token, and the pages that read token rows say they show a sample (analysis/metrics/sampled.py)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from streamlit.testing.v1 import AppTest, app_test

from analysis.ingest import ingest_paths
from analysis.metrics import drilldown, read
from analysis.metrics import token as metrics
from analysis.metrics.sampled import count_text, sample_label, share_text
from analysis.record.logger import DriftLogger
from analysis.store import Store

from helpers.apptest import APP, TIMEOUT, NavigationOnly, open_tab, pick_table
from helpers.logger import make_step, reference_store
from helpers.reference import assert_close, ratio


def logged(tmp_path, token_sample: float, steps=(0, 1, 2), run="sampled") -> Store:
    log = DriftLogger(tmp_path / "logs", run, {"x": 1}, token_sample=token_sample, worst_sequences=1, top_tokens=3)
    for step in steps:
        log.log_step(step, **make_step(B=10, T=25, seed=step))
    store = Store(tmp_path / f"{run}.duckdb")
    outcomes = ingest_paths(store, [tmp_path / "logs"])
    assert {o.status for o in outcomes} == {"loaded"}, [o.line() for o in outcomes]
    return store


@pytest.mark.parametrize("token_sample", [0.1, pytest.param(0.0, marks=pytest.mark.slow)])
@pytest.mark.parametrize("by", ["step", "run"])
def test_finalised_columns_equal_token_level_sql_over_every_token(tmp_path, token_sample, by):
    """METRICS.md columns finalised from the logger's summaries (a sample of token rows stored) against
    metrics.token_metrics over every token of the same steps (the reference database holds them all)."""
    got = read.token_table(logged(tmp_path, token_sample, steps=(4,), run="r"), ["r"], by=by)
    want = metrics.token_metrics(reference_store(tmp_path, make_step(B=10, T=25, seed=4)), ["r"], by=by)
    assert len(got) == len(want) == 1
    g, w = got.row(0, named=True), want.row(0, named=True)
    compared = [c for c in w if c not in ("run", "step")]
    assert len(compared) >= 20
    for c in compared:
        if w[c] is None or isinstance(w[c], str):
            assert g[c] == w[c], c
        else:
            assert math.isclose(g[c], w[c], rel_tol=1e-12, abs_tol=1e-300), (c, g[c], w[c])


def test_label_counts_the_sample(tmp_path):
    store = logged(tmp_path, 0.1)
    n = sum(int(make_step(B=10, T=25, seed=s)["mask"].sum()) for s in range(3))
    kept = store.scalar("SELECT count(*) FROM tokens")
    label = sample_label(store, ["sampled"])
    assert label.startswith(f"tokens: {share_text(kept / n)} sample ({kept} of {n}); curves are exact")
    assert "uniform 10% draw, plus per step the worst sequence by |ΣΔ| and the 3 tokens of largest |Δ|" in label


def test_no_label_when_every_token_is_stored(tmp_path):
    assert sample_label(logged(tmp_path, 1.0), ["sampled"]) is None


def test_summaries_only_label(tmp_path):
    label = sample_label(logged(tmp_path, 0.0), ["sampled"])
    assert label.startswith("tokens: 0% sample (0 of ") and "summaries only" in label


@pytest.mark.parametrize("n, text", [(0, "0"), (999, "999"), (1234, "1.2k"), (1_000_000, "1.0M"),
                                     (1_049_000_000, "1.0B")])
def test_count_text(n, text):
    assert count_text(n) == text


@pytest.mark.parametrize("share, text", [(0.001, "0.1%"), (0.00105, "0.1%"), (0.25, "25%"), (1 / 3, "33%"),
                                         (0.0, "0%")])
def test_share_text(share, text):
    assert share_text(share) == text


def open_page(tmp_path, monkeypatch, page: str) -> AppTest:
    """The app in AppTest on the database `logged` wrote, switched to `page`."""
    monkeypatch.setattr(app_test, "PagesManager", NavigationOnly)
    monkeypatch.setenv("DRIFT_NO_DEMO", "1")
    monkeypatch.setenv("DRIFT_PREFETCH", "0")
    monkeypatch.setenv("DRIFT_DB", str(tmp_path / "sampled.duckdb"))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.run()
    return at.switch_page(page).run()


@pytest.mark.slow  # whole pages in AppTest
@pytest.mark.parametrize("page, tab, prefix", [
    ("pages/sequences.py", None, "The table counts every token (summaries); a sequence's tokens below: "),
    ("pages/token_drift.py", "One run in detail", "Density and token ids: "),
])
def test_pages_reading_token_rows_say_they_show_a_sample(tmp_path, monkeypatch, page, tab, prefix):
    store = logged(tmp_path, 0.1)
    label = sample_label(store, ["sampled"])
    store.close()
    at = open_page(tmp_path, monkeypatch, page)
    if tab:
        open_tab(at, "tokens_tab", tab)
    assert not at.exception, at.exception
    captions = [c.value for c in at.caption]
    assert f"{prefix}{label}." in captions, captions


@pytest.mark.parametrize("token_sample", [0.1, 0.0])
def test_worst_sequences_count_every_token_of_a_sampled_run(tmp_path, token_sample):
    """The Sequences table ranks whole sequences from the summaries: numpy over every token of the step, not the
    fragments of sequences a 10% uniform draw keeps (nor nothing, for a summaries-only run)."""
    data = make_step(B=10, T=25, seed=4)
    store = logged(tmp_path, token_sample, steps=(4,), run="r")
    assert store.scalar("SELECT count(*) FROM tokens") < int(data["mask"].sum()) // 2
    s, t = data["sampler_logprobs"].double().numpy(), data["trainer_logprobs"].double().numpy()
    ref = {}
    for b, sample in enumerate(data["sample_ids"].tolist()):
        keep = data["mask"][b].bool().numpy()
        d = t[b, keep] - s[b, keep]
        ref[sample] = (len(d), d.sum(), np.abs(d).max(), np.mean(ratio(d) - 1 - d))
    worst = drilldown.worst_sequences(store, "r", 4, n=100)
    assert worst["sample"].to_list() == sorted(ref, key=lambda k: (-abs(ref[k][1]), k))
    for row in worst.iter_rows(named=True):
        n, sd, mx, k3 = ref[row["sample"]]
        assert row["n_tokens"] == n and row["response_length"] == n
        for col, want in (("seq_log_ratio", sd), ("seq_log_ratio_abs", abs(sd)), ("max_log_ratio_abs", mx),
                          ("kl_k3", k3)):
            assert_close(row[col], want, col)
    assert drilldown.run_steps(store, "r") == [4]
    assert all(drilldown.summarised(store, "r", 4, q) for q in ref) and not drilldown.summarised(store, "r", 4, 1)


@pytest.mark.slow  # a whole page in AppTest
def test_sequences_page_of_a_summaries_only_run(tmp_path, monkeypatch):
    """token_sample=0: the table still lists the step's sequences; opening one says its token rows were not kept."""
    logged(tmp_path, 0.0).close()
    at = open_page(tmp_path, monkeypatch, "pages/sequences.py")
    assert not at.exception, at.exception
    assert pick_table(at).shape[0] == 10  # every sequence of the step
    assert any("none of its token rows was kept" in i.value for i in at.info), [i.value for i in at.info]
