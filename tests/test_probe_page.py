"""The Lab page's Drift origin tab under AppTest, on a database holding one probe run of the lab model with a
perturbation planted in layer 2: the page names the site the probe table says, draws its three charts, and shows
the tab to a viewer too (reading only); the probe form runs the lab model and loads the result."""
from __future__ import annotations

import shutil

import pytest

from helpers import browser as bu
from helpers.apptest import app_env, errors, open_app, open_tab, texts
from helpers.probe import probe_database

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def probe_db(tmp_path_factory):
    return probe_database(tmp_path_factory.mktemp("probe-page"))


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    app_env(monkeypatch)


def test_drift_origin_tab_names_the_first_site_and_draws(monkeypatch, probe_db):
    db, first = probe_db
    at = open_app(monkeypatch, db, "pages/lab.py")
    assert [t.label for t in at.tabs] == ["Run the lab", "Drift origin"]
    at = open_tab(at, "lab_tab", "Drift origin")
    assert not errors(at) and not at.exception
    shown = texts(at.markdown)
    assert f"Drift starts at layer {first['layer']}, {first['op']}" in shown
    assert bu.app_charts(at) == 3  # divergence by site, first flipped layer, one token's path
    assert at.selectbox(key="probe_run").value == "probe-bf16"
    labels = at.selectbox(key="probe_token").options
    at.selectbox(key="probe_token").set_value(labels[-1]).run()
    assert not errors(at) and bu.app_charts(at) == 3


def test_viewer_sees_the_drift_origin_but_no_form(monkeypatch, probe_db, tmp_path):
    monkeypatch.setenv("DRIFT_READ_ONLY", "1")
    db = tmp_path / "viewer.duckdb"  # its own file: the app holds the other one open for writing
    shutil.copy(probe_db[0], db)
    at = open_app(monkeypatch, db, "pages/lab.py")
    assert "viewer mode" in texts(at.info)
    at = open_tab(at, "lab_tab", "Drift origin")
    assert not errors(at)
    assert not [b for b in at.button if b.key == "probe_start"]
    assert bu.app_charts(at) == 3


def test_probe_form_runs_the_lab_model_and_loads_it(monkeypatch, tmp_path):
    at = open_app(monkeypatch, tmp_path / "drift.duckdb", "pages/lab.py")
    at = open_tab(at, "lab_tab", "Drift origin")
    assert "No probe run in this database yet" in texts(at.info)
    at.number_input(key="probe_tokens").set_value(4)
    at.button(key="probe_start").click().run()
    assert not errors(at), errors(at)
    assert at.selectbox(key="probe_run").value == "probe-lab-bf16-fp32"
    assert "Drift starts at layer 0, input" in texts(at.markdown)  # bf16 rounds the embeddings
