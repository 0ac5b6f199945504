"""The Routing page's flip rate by router margin and the Token drift page's full distribution by length and tag,
on a run logged through DriftLogger with router margins, top-k log-probs and tags (AppTest), and the margin
chart's absence on a run without margins."""
from __future__ import annotations

import pytest

from analysis.ingest import ingest_paths
from analysis.record.logger import DriftLogger
from analysis.store import Store

from helpers import browser as bu
from helpers.apptest import app_env, open_app, open_tab, texts
from helpers.logger import make_step
from helpers.margins import margin_logs

pytestmark = pytest.mark.slow  # whole pages in AppTest

@pytest.fixture
def db(tmp_path, monkeypatch):
    app_env(monkeypatch)
    margin_logs(tmp_path / "logs")
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    store.close()
    return tmp_path / "db.duckdb"


def test_margin_chart_and_full_distribution_by_tag(monkeypatch, db):
    at = open_app(monkeypatch, db, "pages/routing.py")
    open_tab(at, "routing_tab", "Flips per token")
    assert not at.exception and not at.error, (at.exception, at.error)
    assert "**Flips happen where the router is undecided**" in texts(at.markdown)
    assert "**flip_rate_by_margin**" in texts(at.caption) and "sampler's margin" in texts(at.caption)
    assert bu.app_charts(at) == 4  # flips per step, first flip, flip cost, flips by margin

    at.switch_page("pages/token_drift.py").run()
    open_tab(at, "tokens_tab", "Full distribution")
    assert not at.exception and not at.error, (at.exception, at.error)
    assert "**By response length and by tag**" in texts(at.markdown)
    assert bu.app_charts(at) == 3 and len(at.dataframe) == 1
    at.radio(key="tokens_full_dim").set_value("tag").run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert sorted(table["label"]) == ["chat", "code", "math"]


def test_no_margin_chart_without_margins(monkeypatch, tmp_path):
    app_env(monkeypatch)
    DriftLogger(tmp_path / "logs", "plain", token_sample=0.1).log_step(1, **make_step(B=4, T=6))
    store = Store(tmp_path / "db.duckdb")
    ingest_paths(store, [tmp_path / "logs"])
    store.close()
    at = open_app(monkeypatch, tmp_path / "db.duckdb", "pages/routing.py")
    open_tab(at, "routing_tab", "Flips per token")
    assert not at.exception, at.exception
    assert "Flips happen where" not in texts(at.markdown) and bu.app_charts(at) == 3
    assert "RouterCapture.margins()" in texts(at.caption)
