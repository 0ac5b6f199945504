"""The Expert load page under AppTest on the page tests' fixture database: every tab draws without an error box,
the rank view appears once EP ranks are given, the what-if forecasts, and without tags the domain tab says so.
Its queries read the expert_load aggregate (and, bounded, the routing rows for the hot-vs-other drift only)."""
from __future__ import annotations

import shutil

import pytest

from helpers import browser as bu
from helpers.apptest import errors, open_app, open_tab, texts

pytestmark = pytest.mark.slow


@pytest.fixture
def db(app_template_db, tmp_path):
    out = tmp_path / "drift.duckdb"
    shutil.copy(app_template_db, out)
    return out


def test_every_tab(monkeypatch, db):
    at = open_app(monkeypatch, db, "pages/expert_load.py")
    assert at.title[0].value == "Expert load" and not errors(at), errors(at)
    assert [t.label for t in at.tabs] == ["Imbalance", "Ranks", "Hot experts", "What-if", "By domain"]
    assert bu.app_charts(at) == 2  # per-step curves and the layer × expert heat map
    assert "vLLM" in at.table[0].value.to_string()  # the definitions table names the engines

    open_tab(at, "load_tab", "Ranks")
    assert "No placement" in texts(at.info) and not errors(at)
    at.number_input(key="load_ep_size").set_value(4).run()
    assert not errors(at), errors(at)
    assert bu.app_charts(at) == 1 and "placement: experts in contiguous blocks" in texts(at.caption)

    open_tab(at, "load_tab", "Hot experts")
    assert not errors(at), errors(at)
    assert bu.app_charts(at) == 2 and "routing rows" in texts(at.caption)

    open_tab(at, "load_tab", "What-if")
    assert not errors(at), errors(at)
    assert bu.app_charts(at) == 1 and "rebalanced_forecast" in at.dataframe[0].value.columns

    open_tab(at, "load_tab", "By domain")
    assert not errors(at) and "no tags logged" in texts(at.info)

    at.selectbox(key="load_run").set_value(bu.RUN_REPLAY).run()  # sampler-side routing only
    assert not errors(at) and at.radio(key="load_side").options == ["sampler"]


def test_dense_only_says_what_to_log(monkeypatch, db):
    at = open_app(monkeypatch, db, "pages/expert_load.py")
    at.multiselect(key="sidebar_runs").set_value([bu.RUN_DENSE]).run()
    assert "has expert load" in texts(at.info) and not errors(at)
