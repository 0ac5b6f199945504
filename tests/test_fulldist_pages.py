"""The Token drift page's "Full distribution" tab and the Routing page's weight mismatch, on a run logged through
DriftLogger with top-k log-probs and router weights (AppTest), and their absence on a run without them."""
from __future__ import annotations

import pytest

from analysis.ingest import ingest_paths
from analysis.record.logger import DriftLogger
from analysis.store import Store

from helpers import browser as bu
from helpers.apptest import app_env, open_app, open_tab, texts
from helpers.fulldist import add_fulldist
from helpers.logger import make_step

pytestmark = pytest.mark.slow  # whole pages in AppTest


@pytest.fixture
def db(tmp_path, monkeypatch):
    app_env(monkeypatch)
    log = DriftLogger(tmp_path / "logs", "full", token_sample=0.1)
    plain = DriftLogger(tmp_path / "logs", "plain", token_sample=0.1)
    for step in (1, 2, 3):
        data = add_fulldist(make_step(B=8, T=10, seed=step), seed=step)
        log.log_step(step, **data)
        plain.log_step(step, **make_step(B=8, T=10, seed=step))
    store = Store(tmp_path / "db.duckdb")
    assert {o.status for o in ingest_paths(store, [tmp_path / "logs"])} == {"loaded"}
    store.close()
    return tmp_path / "db.duckdb"


def test_full_distribution_tab_and_weight_heatmap(monkeypatch, db):
    at = open_app(monkeypatch, db, "pages/token_drift.py")
    assert [t.label for t in at.tabs][-1] == "Full distribution"
    open_tab(at, "tokens_tab", "Full distribution")
    assert not at.exception and not at.error, (at.exception, at.error)
    assert bu.app_charts(at) == 3  # agreement curves, divergence curves (kl_k3 beside the top-k columns), by length
    captions = texts(at.caption)
    assert "**topk_kl_shared**" in captions and "**topk_tv_upper**" in captions
    assert "Without top-k log-probs (not shown): plain." in captions

    at.switch_page("pages/routing.py").run()
    assert not at.exception, at.exception
    at.selectbox(key="routing_run").set_value("full").run()
    assert "**Routing-weight mismatch, step × layer** (full)" in texts(at.markdown)
    assert "**weight_abs_diff_mean**" in texts(at.caption)
    assert bu.app_charts(at) == 3  # flips heat map, weight heat map, layer profile
    at.selectbox(key="routing_run").set_value("plain").run()
    assert "Routing-weight mismatch" not in texts(at.markdown) and bu.app_charts(at) == 2


def test_no_full_distribution_tab_without_topk(monkeypatch, tmp_path):
    app_env(monkeypatch)
    DriftLogger(tmp_path / "logs", "plain", token_sample=0.1).log_step(1, **make_step(B=4, T=6))
    store = Store(tmp_path / "db.duckdb")
    ingest_paths(store, [tmp_path / "logs"])
    store.close()
    at = open_app(monkeypatch, tmp_path / "db.duckdb", "pages/token_drift.py")
    assert "Full distribution" not in [t.label for t in at.tabs]
